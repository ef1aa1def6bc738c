"""Run recipes: what ``pit-deploy run`` does, stage by stage, in one TOML file.

A run recipe has one table per stage; every key has a default, so a recipe only says what
differs. The ``[train]`` table is the training config (:class:`~pit_deploy.training.config.TrainConfig`:
every option of ``pit-deploy train``) and the ``[export]`` table *is* the export recipe
(:class:`~pit_deploy.exporters.recipes.Recipe`: every field of an export recipe file, plus ``recipe``
to start from a shipped or user export recipe such as ``int4-compact``). Their defaults are
those dataclasses' own; :data:`DEFAULTS` lists only the keys a run sets differently, and
``docs/run.md`` says why for each. Recipes ship as package data in ``pit_deploy/recipes/run/`` (the same TOML language as
the export recipes one folder up); ``./runs/NAME.toml`` or a path to a ``.toml`` file also work.
``--set stage.key=value`` overrides any key; the value is read as TOML (``3``, ``1e-5``,
``true``, ``["onnx", "executorch"]``), or taken as a string when it is not valid TOML (a comma
list, ``x86_64,aarch64``, for a key whose value is a list). A key
that does not exist is an error that names the closest valid key.
"""

from __future__ import annotations

import copy
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PitError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

PACKAGE_RUN_RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "run"
STAGES: tuple[str, ...] = ("convert", "train", "export", "verify", "bench", "report")

#: The run's own keys, and the keys whose run default differs from the command's (``docs/run.md``,
#: "Defaults"). ``train`` also accepts every field of the training config and ``export`` every
#: field of the export recipe, with those dataclasses' defaults.
DEFAULTS: dict[str, dict[str, Any]] = {
    "run": {"description": "", "model": "default", "data": "default"},
    "convert": {"t_init": "preserve", "diagonal": "softplus", "train_z": False, "calib": "default",
                "calib_tokens": 4096},
    "train": {
        # run-only: whether the stage trains, which tyings (a list: PIT and/or the TT baseline), processes
        "enabled": True, "tying": ["pit"], "nproc": 1,
        # a budget `pit-deploy run default` finishes in minutes on a CPU (the command has no default budget)
        "steps": 20, "eval_every": 10, "save_every": 5,
        # short continued pretraining keeps the pretrained weights as trained (0.1 is the from-scratch setting)
        "weight_decay": 0.0,
    },
    "lora": {"enabled": False, "data": "", "rank": 8, "alpha": 16.0, "train_t": False, "steps": 20, "lr": 1e-4},
    # the run ships the factorized artifacts (the command exports both modes); `recipe` starts
    # from an export recipe, whose own values then stand unless this table sets them
    "export": {"recipe": None, "modes": ["factorized"]},
    # isa: whose runtime kernels verify (`pit-deploy verify --isa`): "aarch64" runs the ONNX and .pte
    # artifacts emulated on each arm_cpu profile and kleidiai setting (needs `bash scripts/setup_aarch64.sh`):
    # the compact check that they compute there what they compute on x86, or with full the whole verification
    "verify": {"enabled": True, "isa": ["x86_64"], "arm_cpu": ["cortex-a53", "cortex-a76", "max"],
               "kleidiai": ["on"], "full": False},
    # and threads, prompt_len, gen_len, reps with `pit-deploy bench`'s defaults (_bench_defaults)
    "bench": {"enabled": True},
    "report": {"prompts": ["What is the capital of France?",
                           "Write a Python function that adds two numbers."],
               "max_new_tokens": 24, "val_loss_warn_nats": 0.5},
}

#: Keys of ``[train]`` that the run sets itself (never from the recipe).
RUN_OWNED_TRAIN_KEYS = ("out", "model", "data", "resume", "force", "plot", "progress")
#: old spellings still read in run recipes: table → {old key: key}
ALIASES: dict[str, dict[str, str]] = {"export": {"dtypes": "dtype"}}


def _closest(key: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(key, choices, n=1, cutoff=0.0)
    return f"; did you mean {match[0]!r}?" if match else ""


@dataclass
class RunRecipe:
    """A validated run recipe: ``name`` and one settings dict per table."""

    name: str
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: table → the keys the recipe file gave, and those ``--set`` gave (the others are defaults)
    explicit: dict[str, set[str]] = field(default_factory=dict)
    overridden: dict[str, set[str]] = field(default_factory=dict)
    #: the source model's config once the run has read it (:func:`pit_deploy.workflow.validate.check_run_fits`):
    #: what identifies a model whose own export settings apply (:func:`~pit_deploy.exporters.recipes.model_recipe`)
    source_config: Any = None

    def __getitem__(self, table: str) -> dict[str, Any]:
        return self.tables[table]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **copy.deepcopy(self.tables)}

    def set(self, assignment: str) -> None:
        """Apply one ``table.key=value`` override (value parsed as TOML, else a string)."""
        if "=" not in assignment:
            raise PitError(f"--set {assignment!r}: expected TABLE.KEY=VALUE, e.g. train.steps=50")
        dotted, raw = assignment.split("=", 1)
        if "." not in dotted:
            raise PitError(f"--set {assignment!r}: name the table too, e.g. train.{dotted}=…")
        table, key = dotted.strip().split(".", 1)
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        if isinstance(value, str) and table in DEFAULTS and isinstance(default_of(table, key), (list, tuple)):
            value = [part.strip() for part in value.split(",") if part.strip()]  # verify.isa=x86_64,aarch64
        self._put(table, key, value, f"--set {dotted}")
        self.overridden.setdefault(table, set()).add(ALIASES.get(table, {}).get(key, key))

    def _put(self, table: str, key: str, value: Any, where: str) -> None:
        if table not in DEFAULTS:
            raise PitError(f"{where}: unknown table [{table}]{_closest(table, list(DEFAULTS))} "
                           f"(tables: {', '.join(DEFAULTS)})")
        key = ALIASES.get(table, {}).get(key, key)
        allowed = table_keys(table)
        if key not in allowed:
            raise PitError(f"{where}: unknown key {table}.{key}{_closest(key, allowed)} "
                           f"(keys of [{table}]: {', '.join(allowed)})")
        if table == "train" and key in RUN_OWNED_TRAIN_KEYS:
            raise PitError(f"{where}: train.{key} is set by the run itself; use [run] model/data instead")
        _check_type(f"{where}: {table}.{key}", value, default_of(table, key))
        self.tables[table][key] = value
        self.explicit.setdefault(table, set()).add(key)

    def value(self, table: str, key: str) -> Any:
        """``table.key`` as the run uses it: the recipe's value, else its default."""
        values = self.tables[table]
        return values[key] if key in values else default_of(table, key)

    def effective(self, table: str) -> dict[str, Any]:
        """Every key of ``table`` with the value the run uses (what a stage record compares)."""
        return {key: self.value(table, key) for key in table_keys(table)}

    def export_recipe(self) -> Any:
        """The export recipe of ``[export]``: the named ``recipe`` (or the built-in defaults with
        the run's :data:`DEFAULTS`), then the keys the run recipe gave. A ``recipe`` named by
        ``--set`` replaces the run recipe file's own export settings (only other ``--set`` keys
        change it); one named in the file is refined by the file's keys. Without a named
        ``recipe``, the quantization settings measured on the run's model, where there are some
        (``MODEL_RECIPES``: the bundled SmolLM2-135M's ``smollm2-135m``), fill the keys the run
        recipe leaves out."""
        from ..exporters.recipes import Recipe, load_recipe

        table = self.tables["export"]
        cli = self.overridden.get("export", set())
        given = self.explicit.get("export", set())
        if table.get("recipe"):
            base = load_recipe(str(table["recipe"]))
            if "recipe" in cli:
                given = cli
        else:
            base = Recipe(**{k: v for k, v in DEFAULTS["export"].items() if k != "recipe"})
        changes = {k: table[k] for k in given if k != "recipe"}
        resolved = base.override(name=f"run-{self.name}", **changes)
        if not table.get("recipe"):
            resolved = _with_model_settings(resolved, self.tables["run"]["model"], self.source_config, set(changes))
        return resolved


def _with_model_settings(recipe: Any, source: str, config: Any, given: set[str]) -> Any:
    """``recipe`` with the quantization settings measured on the model ``source`` (``config``:
    its config, ``None`` before the run reads it) for the keys not in ``given`` and read by one
    of the recipe's targets; as it is when the export quantizes nothing or no settings were
    measured on the model, or when they do not go with the settings the run recipe gives (a
    ``pte_head_bits`` that needs another ``table_bits``): then the schemes' own settings stand."""
    from ..errors import PitError
    from ..exporters.recipes import ALL, model_recipe, model_settings
    from ..schemes import get_scheme
    from ..targets import get_target, target_names

    name = model_recipe(source, config)
    if name is None or not any(get_scheme(d).quantized for d in recipe.dtype):
        return recipe
    runtimes = target_names() if recipe.runtimes == (ALL,) else recipe.runtimes
    read = {k for r in runtimes for k in get_target(r).scheme_settings}
    settings = {k: v for k, v in model_settings(name).items() if k not in given and k in read}
    try:
        return recipe.override(**settings) if settings else recipe
    except PitError:
        return recipe


def table_keys(table: str) -> list[str]:
    """Every key table ``table`` accepts: its run keys and, for ``train``/``export``, every
    field of the training config / export recipe."""
    keys = list(DEFAULTS[table])
    if table == "train":
        keys += [k for k in train_config_keys() if k not in keys and k not in RUN_OWNED_TRAIN_KEYS]
    elif table == "export":
        from ..exporters.recipes import recipe_fields

        keys += [k for k in recipe_fields() if k not in keys]
    elif table == "bench":
        keys += [k for k in _bench_defaults() if k not in keys]
    return keys


def _bench_defaults() -> dict[str, Any]:
    """``[bench]``'s measurement keys with ``pit-deploy bench``'s defaults (``BenchOptions``)."""
    from ..evaluate.bench import run_table_defaults

    return run_table_defaults()


def default_of(table: str, key: str) -> Any:
    """The default of ``table.key``: the run's own (:data:`DEFAULTS`), else the dataclass's."""
    if key in DEFAULTS[table]:
        return DEFAULTS[table][key]
    if table == "train":
        from ..training.config import default_of as train_default

        return train_default(key)
    if table == "export":
        from ..exporters.recipes import Recipe
        from ..options import field_default

        return field_default(Recipe, key)
    if table == "bench":
        return _bench_defaults().get(key)
    return None


def _check_type(what: str, value: Any, default: Any) -> None:
    """A value of the default's kind (an int is a float too; a list stands for a tuple); keys
    whose default is unset take anything their stage validates."""
    if default is None:
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(default, (list, tuple)):
        ok = isinstance(value, (list, tuple))
    else:
        ok = isinstance(value, type(default))
    if not ok:
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
            type(default), "a list" if isinstance(default, (list, tuple)) else type(default).__name__)
        raise PitError(f"{what} must be {kind} (like {default!r}), got {value!r}")


def train_config_keys() -> list[str]:
    """Field names of the training config."""
    from dataclasses import fields

    from ..training.config import TrainConfig

    return [f.name for f in fields(TrainConfig)]


def run_recipe_dirs() -> list[Path]:
    return [Path.cwd() / "runs", PACKAGE_RUN_RECIPES]


def available_run_recipes() -> list[str]:
    return sorted({p.stem for d in run_recipe_dirs() if d.is_dir() for p in d.glob("*.toml")})


#: what a run recipe file is
TOML_ONLY = "run recipes are TOML files ending in .toml (docs/run.md)"


def find_run_recipe(name: str) -> Path:
    """The file of run recipe ``name``: a path to a ``.toml`` file, else a shipped recipe or one
    in ``./runs/`` by its name.

    Raises:
        PitError: a missing ``.toml`` path; a path to a file or directory that is not a ``.toml``
            file (naming what it is); an unknown name.
    """
    path = Path(name).expanduser()
    if path.suffix.lower() == ".toml":
        if path.is_file():
            return path
        if path.is_dir():
            raise PitError(f"run recipe {path} is a directory, not a file; {TOML_ONLY}")
        raise PitError(f"run recipe {path} does not exist")
    for folder in run_recipe_dirs():
        candidate = folder / f"{name}.toml"
        if candidate.is_file():
            return candidate
    if path.is_file():
        raise PitError(f"{path} is not a run recipe: {_not_toml(path)}; {TOML_ONLY}")
    if path.is_dir():
        raise PitError(f"{path} is a directory, not a run recipe; {TOML_ONLY}")
    if path.suffix[1:].isalpha():  # a file name (some.json), not a recipe name with a dot in it
        raise PitError(f"run recipe {path} does not exist, and a {path.suffix} file is not a run recipe: {TOML_ONLY}")
    known = available_run_recipes()
    raise PitError(f"unknown run recipe {name!r}{_closest(name, known)} (shipped: {', '.join(known)}); "
                   "or pass a path to a .toml file")


def _not_toml(path: Path) -> str:
    """What the existing file ``path`` (not named ``.toml``) is, as far as a run recipe goes."""
    kind = f"a {path.suffix} file" if path.suffix else "a file without the .toml suffix"
    try:
        tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return f"{kind} that is not TOML"
    return f"{kind} (it reads as TOML: rename it to {path.stem}.toml)"


def load_run_recipe(name: str = "default", overrides: list[str] | None = None) -> RunRecipe:
    """Read a run recipe, fill defaults, apply ``--set`` overrides and validate every key."""
    path = find_run_recipe(name)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise PitError(f"cannot parse run recipe {path}: {exc or 'nested too deep'}; {TOML_ONLY}") from None
    except OSError as exc:
        raise PitError(f"cannot read run recipe {path}: {exc.strerror or exc}") from None
    recipe = RunRecipe(name=path.stem, tables=copy.deepcopy(DEFAULTS))
    recipe.tables["bench"].update(_bench_defaults())
    for table, values in data.items():
        if not isinstance(values, dict):
            if table == "description":
                recipe.tables["run"]["description"] = values
                continue
            raise PitError(f"{path}: top-level key {table!r} must be a table like [{table}]"
                           f"{_closest(table, list(DEFAULTS))}")
        for key, value in values.items():
            recipe._put(table, key, value, str(path))
    for assignment in overrides or []:
        recipe.set(assignment)
    _check_values(recipe)
    return recipe


def _check_values(recipe: RunRecipe) -> None:
    train = recipe["train"]
    bad = [t for t in _as_list(train["tying"]) if t not in ("pit", "tt")]
    if bad or not _as_list(train["tying"]):
        raise PitError(f"train.tying must list 'pit' and/or 'tt', got {train['tying']!r}")
    if not isinstance(train["nproc"], int) or train["nproc"] < 1:
        raise PitError(f"train.nproc must be an integer ≥ 1, got {train['nproc']!r}")
    bench = recipe["bench"]
    if any(not isinstance(t, int) or t < 1 for t in _as_list(bench["threads"])):
        raise PitError(f"bench.threads must be integers ≥ 1, got {bench['threads']!r}")
    try:  # every later stage's own checks, before any slow stage runs
        recipe.export_recipe()
    except PitError as exc:
        raise PitError(f"[export]: {exc}") from None
    _check_train(recipe)
    _check_bench(recipe)
    if recipe["lora"]["enabled"] and not recipe["lora"]["data"]:
        raise PitError("lora.enabled needs lora.data (prompt/completion JSONL or text); set it with "
                       "--set lora.data=PATH")


def _check_train(recipe: RunRecipe) -> None:
    """The training config's own validation of ``[train]`` (as each training job will see it)."""
    from ..training.config import TrainConfig, validate, with_start_defaults

    if not recipe["train"]["enabled"]:
        return
    options = {k: v for k, v in recipe.effective("train").items() if k in train_config_keys()}
    options.update(out="run", model=recipe["run"]["model"], data=recipe["run"]["data"], tying="pit")
    if options.get("tokens"):
        options["steps"] = None
    else:
        options["tokens"] = None
    try:
        validate(with_start_defaults(TrainConfig(**options)))
    except PitError as exc:
        raise PitError(f"[train]: {exc}") from None


def _check_bench(recipe: RunRecipe) -> None:
    from ..evaluate.bench import bench_options

    bench = recipe["bench"]
    if not bench["enabled"]:
        return
    try:
        bench_options(bench)
    except PitError as exc:
        raise PitError(f"[bench]: {exc}") from None


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]
