"""Quantization schemes: named objects that carry their settings, their parity bounds and the
name of the artifacts they make.

A scheme is what a recipe's ``dtype`` list names (``float32``, ``int8``, ``int4``,
``int4-compact``, …). Its ``dtype`` is what the runtimes' exporters implement; its settings say
how (group size, bits of the token table, the linears kept at 8 bits, the PIT correction, the
``.pte`` head); its bounds are what ``verify`` holds an artifact of it to; and its name is the
artifact's suffix, so two schemes of one dtype sit side by side in one export directory
(``onnx-factorized-int4`` and ``onnx-factorized-int4-compact``). The schemes more than one
target writes are registered here; a scheme only one target writes (llama.cpp's file types, the
``.pte``'s ``int4-shared``, the web schemes) is declared in that target's folder
(``Target.own_schemes``) and joins the registry on first lookup (:func:`registered`). A new
scheme is one :func:`register_scheme` call or one ``own_schemes`` entry (``docs/design.md``).

FP32 bounds (``docs/definitions.md``, "Parity"): full-sequence and step-by-step logits within
relative L2 ``1e-4`` of the PyTorch reference, 100 % top-1 agreement, an identical 32-token
greedy continuation, and ``delta_ti ≤ 1e-5`` from the runtime's own embedding and head.

Quantized bounds (``docs/quantization.md``, "Verification bounds"): the KL divergence of the runtime's
next-token distribution from the fp32 reference on the held-out set (mean and 99th percentile),
the same-top-1 rate, the perplexity ratio and — for factorized artifacts with the PIT
correction — ``delta_ti``. The built-in values were set from the default model's measurements
with a stated margin; a recipe's ``[bounds.<scheme>]`` table overrides them. Those absolute
values mean little on another model, so the KL is also bounded relative to the artifact's own
expected quantization error, recorded at export (:meth:`QuantizedBounds.scaled_kl_bound`).

Standard library only (read where a manifest is read; the target declarations are too).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .errors import PitError

GROUP_SIZES = (16, 32, 64, 128, 256)
#: ``float16``: a float format judged like a quantized one (KL bounds), written by the gguf target only
DTYPES = ("float32", "float16", "int8", "int4")
#: how a scheme's weights are rounded (``Scheme.rounding``)
ROUNDINGS = ("rtn", "gptq")
#: what a quantized factorized ONNX head multiplies its table with (``Scheme.head_activations``)
HEAD_ACTIVATIONS = ("float32", "int8")


@dataclass(frozen=True)
class ParityBounds:
    """Bounds of an fp32 artifact. ``None`` means the figure is reported but not bounded."""

    logits_rel_l2: float | None = 1e-4
    top1_agreement: float | None = 1.0
    greedy_tokens: int = 32
    greedy_identical: bool = True
    delta_ti: float | None = 1e-5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class QuantizedBounds:
    """Bounds of a quantized artifact (KL figures against the fp32 reference).

    ``delta_ti`` applies where the export claims an exact interface (factorized with the PIT
    correction, or with an unquantized table); for the others (materialized, uncorrected,
    tied) ``delta_ti`` is reported, not bounded.
    """

    kl_mean: float = 0.1
    kl_p99: float = 1.0
    same_top1: float = 0.8
    ppl_ratio: float = 1.2
    delta_ti: float = 1e-4
    #: the scaled check, where the export recorded the artifact's expected error (the KL of the
    #: fp32 model with its weights rounded to the scheme's grid in PyTorch): ``kl_mean ≤
    #: max(expected_factor × expected kl_mean, expected_floor)``, and the same for ``kl_p99``
    expected_factor: float = 4.0
    expected_floor: float = 1e-5
    expected_factor_p99: float = 4.0
    expected_floor_p99: float = 1e-4

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def scaled_kl_bound(self, expected_mean: float, expected_p99: float) -> tuple[float, float]:
        """``(kl_mean, kl_p99)`` an artifact may reach given the KL its weight rounding alone
        costs (measured at export, :mod:`pit_deploy.exporters.expected_error`). Why a factor: the
        runtimes also quantize activations, which the expected figure leaves out; why a floor:
        an expected error near zero would otherwise leave no room for that rounding. Both were
        set from measurements (``docs/quantization.md``, "Verification bounds")."""
        return (max(self.expected_factor * expected_mean, self.expected_floor),
                max(self.expected_factor_p99 * expected_p99, self.expected_floor_p99))


@dataclass(frozen=True)
class SchemeSetting:
    """A quantization setting that the schemes carry and that an export recipe, ``pit-deploy
    export``'s flag and the Python API may override for every quantized scheme of an export.

    Declared once, in :data:`SETTINGS`: the :class:`Scheme` field and its default, the export
    recipe's field, flag and help (:class:`pit_deploy.exporters.recipes.Recipe`), the check of a
    value and whether only the schemes that store int8/int4 codes read it all derive from the
    entry: :class:`Scheme`'s typed field takes its default (:func:`setting_default`), the recipe's
    its flag and help. Which targets read a setting is said by each target
    (``Target.scheme_settings``, next to its exporter), so that a new target stays in its own
    module. A new setting is one entry here, a field of :class:`Scheme` and of the recipe, the
    exporters that read it, and their targets' ``scheme_settings``.
    """

    name: str
    #: the value's type, written as a dataclass annotation
    annotation: str
    #: the schemes' default (a scheme may set its own)
    default: Any
    #: the export flag's help (``pit-deploy export --help``)
    help: str
    #: the export flag when not ``--name-with-dashes`` (``--no-…`` for a setting that is on by default)
    flag: str | None = None
    #: the values a value must be one of, and how an error names them
    values: tuple[Any, ...] | None = None
    values_text: str = ""
    #: whether the command line refuses a value outside ``values`` itself (argparse ``choices``)
    cli_choices: bool = False
    #: read only by the schemes that store int8/int4 codes (refused with float32 or f16 alone)
    coded: bool = False
    #: how a quantized artifact's manifest records it (:meth:`Scheme.settings`): always, or only
    #: where the scheme changed it from :attr:`default` (a setting added later leaves the records
    #: of the schemes that do not use it as they were)
    always_recorded: bool = True
    #: the :class:`Scheme` attribute whose value the manifest records, where it is not the field
    #: itself (the bits a ``.pte``'s head really has; the 8-bit layers of an int4 scheme only)
    recorded_as: str | None = None

    def check(self, value: Any) -> None:
        """Raise :class:`PitError` for a value of the wrong kind or outside :attr:`values`."""
        if self.annotation == "bool":
            ok, wanted = isinstance(value, bool), "true or false"
        elif self.annotation.startswith("tuple"):
            ok = isinstance(value, (list, tuple)) and all(isinstance(n, str) and n for n in value)
            wanted = "a list of layer names (e.g. [\"v_proj\", \"down_proj\"])"
        else:
            ok = not isinstance(value, bool) and (self.values is None or value in self.values)
            wanted = self.values_text or ", ".join(map(str, self.values or ()))
        if not ok:
            raise PitError(f"{self.name} must be {wanted}, got {value!r}")


#: every scheme setting a recipe may override, in the order recipes, flags and manifests list them
SETTINGS: tuple[SchemeSetting, ...] = (
    SchemeSetting("group_size", "int", 32, "int4/int8 block size along the input dimension (default: the scheme's, 32)",
                  values=GROUP_SIZES, values_text="one of " + ", ".join(map(str, GROUP_SIZES))),
    SchemeSetting("pit_correction", "bool", True, "factorized quantized: keep T⁻¹ instead of (ẐᵀẐ)⁻¹T⁻¹ (W_out E then "
                  "drifts from I)", flag="--no-pit-correction"),
    SchemeSetting("table_bits", "int", 8, "bits of the quantized token tables (default: the scheme's): ONNX head and "
                  "embedding, the .pte embedding's gather table", values=(4, 8), values_text="4 or 8", cli_choices=True),
    SchemeSetting("int4_8bit_layers", "tuple[str, ...]", (),
                  "int4: comma list of linears kept at 8 bits: down_proj (every layer's) or "
                  "layers.3.mlp.down_proj (one layer's) (default: the scheme's)", recorded_as="recorded_8bit_layers"),
    SchemeSetting("pte_head_bits", "int", 0, "quantized factorized .pte with a head of its own: 0 keeps the fp32 head "
                  "(default); 4 or 8 quantizes it behind a rotation (smaller, faster; W_out E = I still holds on the "
                  "runtime)", values=(0, 4, 8), values_text="0 (a float32 head), 4 or 8", cli_choices=True,
                  recorded_as="pte_quantized_head_bits"),
    SchemeSetting("pte_shared_table", "bool", False, "quantized factorized .pte: a head of its own (fp32 or "
                  "--pte-head-bits) instead of one quantized table that the head and the gather share (int4's "
                  "default)", flag="--no-pte-shared-table", always_recorded=False),
    SchemeSetting("rounding", "str", "rtn", "how the body linears are rounded: rtn (nearest grid point) or gptq (error "
                  "feedback from calibration text, in PyTorch; the exporter writes those codes) (default: the "
                  "scheme's)", values=ROUNDINGS, values_text="one of " + ", ".join(ROUNDINGS), cli_choices=True,
                  coded=True),
    SchemeSetting("head_activations", "str", "float32", "quantized factorized ONNX: the head's MatMulNBits "
                  "with float32 activations, or int8 ones (faster; its d x d factor is put on the int8 grid so "
                  "that W_out E = I still holds on the runtime) (default: the scheme's)",
                  values=HEAD_ACTIVATIONS, values_text="float32 or int8", cli_choices=True, always_recorded=False),
    SchemeSetting("genai_group_size", "int", 0, "quantized onnx-genai: its MatMulNBits block size (body and token "
                  "table) where it should differ from --group-size, which the other targets of the export keep; "
                  "0 takes --group-size (default: the scheme's)", values=(0,) + GROUP_SIZES,
                  values_text="0 (the group size) or one of " + ", ".join(map(str, GROUP_SIZES)), always_recorded=False),
    SchemeSetting("rotate_residual", "bool", False, "quantized .pte: round the body without first rotating the "
                  "residual stream by a randomized Hadamard matrix (int4's default rotates)",
                  flag="--no-rotate-residual", coded=True, always_recorded=False),
)


def setting_entry(name: str) -> SchemeSetting:
    """The :data:`SETTINGS` entry ``name``."""
    return next(s for s in SETTINGS if s.name == name)


def setting_default(name: str) -> Any:
    """A :class:`Scheme` field's default: its :data:`SETTINGS` entry's (one place for each)."""
    return setting_entry(name).default


@dataclass(frozen=True)
class Scheme:
    """One way of storing an artifact's weights (see the module docstring).

    Attributes:
        name: what recipes and ``--dtype`` name; the artifact folder's suffix (none for float32).
        dtype: what the exporters implement: ``float32``, ``int8`` or ``int4``.
        bounds: the parity bounds an artifact of this scheme must meet.
        group_size: int4 blocks / int8 table blocks along the input dimension.
        table_bits: bits of the token tables (ONNX head and embedding, ``.pte`` gather).
        int4_8bit_layers: int4: linears kept at 8 bits, each named by its last component (``down_proj``:
            every layer's) or by a dotted suffix of its module path (``layers.3.mlp.down_proj``: one
            layer's), :meth:`keeps_8bit`.
        pit_correction: factorized: ``T⁻¹ → (ẐᵀẐ)⁻¹T⁻¹`` so ``W_out E = I`` holds on the runtime.
        pte_head_bits: quantized factorized ``.pte``: 0 keeps the fp32 head, 4/8 a rotated
            quantized head.
        pte_shared_table: quantized factorized ``.pte``: the head is a quantized linear at
            ``table_bits`` whose codes the gather reads too, and the program's constants go to
            ``model.ptd``, where the one table is stored once (``pte_head_bits`` must then be 0
            or ``table_bits``).
        fold_at_load: ONNX: store the codes in standard operators that onnxruntime folds back to
            float32 when the session is created (loads in onnxruntime-web's default build, fp32
            kernels at run time: a smaller file, not less memory) instead of ``MatMulNBits`` /
            ``GatherBlockQuantized``.
        rounding: ``rtn`` rounds each weight to its nearest grid point (in the runtime's own
            quantizer); ``gptq`` rounds the body linears in PyTorch with error feedback from
            calibration text (:mod:`pit_deploy.exporters.calibrated_rounding`) and the exporter
            writes those codes as they are.
        head_activations: quantized factorized ONNX (``onnx``, ``onnx-genai``): ``float32`` runs the
            head's ``MatMulNBits`` on float32 activations, ``int8`` on int8 ones per block
            (``accuracy_level`` 4, the body's kernel), with the head's ``d×d`` factor on that grid so
            that ``W_out E = I`` holds on the runtime
            (:func:`pit_deploy.exporters.onnx_tables.int8_block_grid_rows`).
        rotate_residual: quantized ``.pte``: rotate the residual stream by a randomized Hadamard
            matrix before the body is rounded (:mod:`pit_deploy.exporters.residual_rotation`; the
            float32 model computes the same, the interface is untouched).
        genai_group_size: quantized ``onnx-genai``: the group size of that target's artifacts
            where it differs from ``group_size`` (0: ``group_size``). The other targets of one
            export keep ``group_size``: the best block differs between runtimes' kernels.
        runtimes: the targets this scheme is meant for (``None``: every target of its dtype).
        gptq_bounds: the bounds of an artifact whose body carries GPTQ codes (its manifest says
            ``rounding: gptq``), where they were measured apart from the plain rounding's;
            ``None``: ``bounds`` for both.
    """

    name: str
    dtype: str
    bounds: ParityBounds | QuantizedBounds
    description: str = ""
    # the SETTINGS, typed, with their entries' defaults (tests/test_schemes.py checks they match)
    group_size: int = setting_default("group_size")
    pit_correction: bool = setting_default("pit_correction")
    table_bits: int = setting_default("table_bits")
    int4_8bit_layers: tuple[str, ...] = setting_default("int4_8bit_layers")
    pte_head_bits: int = setting_default("pte_head_bits")
    pte_shared_table: bool = setting_default("pte_shared_table")
    rounding: str = setting_default("rounding")
    head_activations: str = setting_default("head_activations")
    rotate_residual: bool = setting_default("rotate_residual")
    genai_group_size: int = setting_default("genai_group_size")
    fold_at_load: bool = False
    runtimes: tuple[str, ...] | None = None
    gptq_bounds: QuantizedBounds | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise PitError(f"scheme {self.name}: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for entry in SETTINGS:
            entry.check(getattr(self, entry.name))
        object.__setattr__(self, "int4_8bit_layers", tuple(self.int4_8bit_layers))
        if self.pte_shared_table and self.pte_head_bits not in (0, self.table_bits):
            raise PitError(f"scheme {self.name}: a shared token table needs pte_head_bits equal to table_bits "
                           f"(the head and the gather read one table), got {self.pte_head_bits} and {self.table_bits}; "
                           "pass --no-pte-shared-table for a head of its own")
        if self.rotate_residual and not self.quantized:
            raise PitError(f"scheme {self.name}: rotate_residual applies to quantized schemes (it helps their "
                           "rounding); drop it for float32")
        if not isinstance(self.fold_at_load, bool):
            raise PitError(f"fold_at_load must be true or false, got {self.fold_at_load!r}")
        if self.head_activations != "float32" and self.fold_at_load:
            raise PitError(f"scheme {self.name}: head_activations {self.head_activations} applies to MatMulNBits "
                           "heads; a scheme folded at load has float32 kernels only; drop it")
        if self.rounding != "rtn" and (self.fold_at_load or not self.quantized):
            raise PitError(f"scheme {self.name}: rounding {self.rounding} applies to the int8/int4 schemes that "
                           "store codes (not float32, not the web schemes folded at load); drop it for this dtype")

    @property
    def quantized(self) -> bool:
        return self.dtype != "float32"

    def reads(self, name: str) -> bool:
        """Whether this scheme reads the :data:`SETTINGS` entry ``name``: a quantized scheme reads
        them all, but only one that stores int8/int4 codes reads a ``coded`` one (the rounding)."""
        coded = next(s.coded for s in SETTINGS if s.name == name)
        return self.quantized and (not coded or self.dtype in ("int8", "int4"))

    @property
    def pte_quantized_head_bits(self) -> int:
        """Bits of a factorized ``.pte``'s quantized head: the table's when it is shared, else
        ``pte_head_bits`` (0: a float32 head)."""
        return self.table_bits if self.pte_shared_table else self.pte_head_bits

    def keeps_8bit(self, module_path: str) -> bool:
        """Whether the int4 scheme keeps the linear at ``module_path`` (``model.layers.3.mlp.down_proj``)
        at 8 bits: one of :attr:`int4_8bit_layers` is its last component or a dotted suffix of it."""
        return names_linear(module_path, self.int4_8bit_layers)

    def artifact_suffix(self) -> str:
        """``""`` for float32, ``-<name>`` otherwise (``onnx-factorized-int4-compact``)."""
        return "" if self.name == "float32" else f"-{self.name}"

    def with_settings(self, **settings: Any) -> "Scheme":
        """A copy with every non-``None`` setting replaced (validated)."""
        return replace(self, **{k: v for k, v in settings.items() if v is not None})

    def with_bounds(self, overrides: dict[str, Any] | None) -> "Scheme":
        """A copy whose bounds take a recipe's ``[bounds.<scheme>]`` values (validated)."""
        gptq = None if self.gptq_bounds is None else apply_bounds(self.name, self.gptq_bounds, overrides)
        return replace(self, bounds=apply_bounds(self.name, self.bounds, overrides), gptq_bounds=gptq)

    def bounds_of(self, rounding: str = "rtn") -> ParityBounds | QuantizedBounds:
        """The bounds of an artifact rounded by ``rounding`` (``gptq_bounds`` where set)."""
        return self.gptq_bounds if rounding == "gptq" and self.gptq_bounds is not None else self.bounds

    @property
    def recorded_8bit_layers(self) -> list[str]:
        """The linears kept at 8 bits as the manifest records them: an int4 scheme's, else none."""
        return list(self.int4_8bit_layers) if self.dtype == "int4" else []

    def settings(self) -> dict[str, Any]:
        """What the manifest records of the scheme an artifact was made with: its name and dtype,
        and for a quantized scheme every :data:`SETTINGS` entry as the entry says
        (``always_recorded``, ``recorded_as``), and ``fold_at_load`` where it is set."""
        out: dict[str, Any] = {"name": self.name, "dtype": self.dtype}
        if not self.quantized:
            return out
        for entry in SETTINGS:
            value = getattr(self, entry.recorded_as or entry.name)
            if entry.always_recorded or value != entry.default:
                out[entry.name] = list(value) if isinstance(value, tuple) else value
        if self.fold_at_load:
            out["fold_at_load"] = True
        return out


def names_linear(module_path: str, names: tuple[str, ...]) -> bool:
    """Whether one of ``names`` names the linear at ``module_path``: its last component
    (``down_proj``: every layer's) or a dotted suffix of its path (``layers.3.mlp.down_proj``)."""
    return any(module_path == name or module_path.endswith("." + name) for name in names)


#: the schemes registered so far: the shared ones below, then each target's own (:func:`registered`)
SCHEMES: dict[str, Scheme] = {}
#: the targets whose own schemes are in :data:`SCHEMES`
_LOADED_TARGETS: set[str] = set()


def register_scheme(scheme: Scheme) -> Scheme:
    """Add (or replace) ``scheme`` under its name."""
    SCHEMES[scheme.name] = scheme
    return scheme


def target_scheme(target: str, spec: dict[str, Any]) -> Scheme:
    """A scheme one target declares as data (``Target.own_schemes``): :class:`Scheme`'s keyword
    arguments, with ``bounds`` (and ``gptq_bounds``) a dict of the bound fields or the name of a
    shared scheme whose bounds it is held to, and ``runtimes`` the declaring target.

    Raises:
        PitError: a declaration that is not a valid scheme (naming the target).
    """
    def bounds(value: Any, dtype: str) -> ParityBounds | QuantizedBounds | None:
        if value is None:
            return None
        if isinstance(value, str):
            return SCHEMES[value].bounds
        return ParityBounds(**value) if dtype == "float32" else QuantizedBounds(**value)

    try:
        fields_ = dict(spec)
        dtype = fields_["dtype"]
        fields_["bounds"] = bounds(fields_["bounds"], dtype)
        fields_["gptq_bounds"] = bounds(fields_.get("gptq_bounds"), dtype)
        return Scheme(**fields_, runtimes=(target,))
    except (KeyError, TypeError) as exc:
        raise PitError(f"the {target} target declares an invalid scheme {spec.get('name')!r}: {exc}") from None


def registered() -> dict[str, Scheme]:
    """Every scheme: the shared ones, then those the known targets declare
    (:attr:`pit_deploy.targets.base.Target.own_schemes`), in target order. A target's own schemes
    live in its folder's declaration and join here on the first lookup after it is known."""
    from .targets import get_target, target_names

    for name in target_names():
        if name not in _LOADED_TARGETS:
            _LOADED_TARGETS.add(name)
            for spec in get_target(name).own_schemes:
                register_scheme(target_scheme(name, spec))
    return SCHEMES


def scheme_names() -> tuple[str, ...]:
    """Every scheme's name (:func:`registered`)."""
    return tuple(registered())


def get_scheme(name: str) -> Scheme:
    """The scheme called ``name`` (shared, or one target's own: :func:`registered`).

    Raises:
        PitError: no such scheme.
    """
    known = registered()
    try:
        return known[name]
    except KeyError:
        raise PitError(f"unknown dtype/scheme {name!r}; choose from {', '.join(known)}") from None


def apply_bounds(name: str, base: ParityBounds | QuantizedBounds,
                 overrides: dict[str, Any] | None) -> ParityBounds | QuantizedBounds:
    """``base`` with a recipe's ``[bounds.<name>]`` values.

    Raises:
        PitError: an override naming a field the bounds do not have, or not a finite number
            (``inf`` would switch a check off, ``nan`` fail every artifact).
    """
    if not overrides:
        return base
    names = {f.name for f in fields(base)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise PitError(f"bounds for {name} have no field(s) {unknown}; allowed: {', '.join(sorted(names))}")
    for key, value in overrides.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PitError(f"bounds.{name}.{key} must be a finite number, got {value!r}")
    return replace(base, **overrides)


def bounds_for(name: str, overrides: dict[str, Any] | None = None, rounding: str = "rtn") -> ParityBounds | QuantizedBounds:
    """The bounds of the scheme (or, for manifests written before schemes, the dtype) ``name``
    for an artifact rounded by ``rounding``, with a recipe's ``[bounds.<name>]`` values applied.

    Raises:
        PitError: an unknown scheme, or an invalid override.
    """
    return apply_bounds(name, get_scheme(name).bounds_of(rounding), overrides)


# Default-model measurements behind these values: docs/quantization.md ("Verification bounds").
INT4_BOUNDS = QuantizedBounds(kl_mean=0.5, kl_p99=4.0, same_top1=0.6, ppl_ratio=1.6)
register_scheme(Scheme("float32", "float32", ParityBounds(), "full precision"))
# int8's scaled factor is 10, not 4: XNNPACK's 8da8w rounds every linear's input to int8 per token,
# which the expected error leaves out and which dominates when the weights are 8-bit (default
# model .pte: 4.3× the expected kl_mean); studies/quantized-scaling.md.
register_scheme(Scheme("int8", "int8", QuantizedBounds(kl_mean=0.05, kl_p99=0.5, same_top1=0.85, ppl_ratio=1.1,
                                                       expected_factor=10.0, expected_factor_p99=10.0),
                       "8-bit weights and token tables", head_activations="int8"))
# The ONNX targets' factorized heads read int8 activations in int8, int4 and int4-compact (the body's
# kernel, faster at the same held-out KL, the head's d x d factor on that kernel's grid so that
# W_out E = I holds: studies/onnx-genai-int4.md, "A head with int8 activations").
# int4's .pte: the head an 8-bit linear over the gather's own 8-bit table, stored once (model.ptd);
# measured on the default model: the fp32 head's KL at 104.6 MB instead of 222.9 (studies/pte-head-and-table.md).
# int4's body is GPTQ-rounded where the target writes calibrated codes (.pte, onnx, and onnx-genai into
# the builder's nodes; docs/quantization.md, "Calibrated rounding"). GPTQ artifacts are held to bounds
# set from their own measurements on the default model, with a margin of about 2x on the KL; the
# measurements behind them are in studies/gptq.md, "The GPTQ bounds".
INT4_GPTQ_BOUNDS = QuantizedBounds(kl_mean=0.12, kl_p99=0.9, same_top1=0.82, ppl_ratio=1.1)
register_scheme(Scheme("int4", "int4", INT4_BOUNDS,
                       "4-bit linears in groups of 32 rounded by GPTQ, v_proj/down_proj and the token tables at 8 "
                       "bits (a .pte's head and gather read one 8-bit table, GPTQ-rounded too)",
                       int4_8bit_layers=("v_proj", "down_proj"), pte_shared_table=True, rounding="gptq",
                       rotate_residual=True, gptq_bounds=INT4_GPTQ_BOUNDS, head_activations="int8"))
register_scheme(Scheme("int4-compact", "int4", INT4_BOUNDS,
                       "the smallest int4 within the int4 bounds: a 4-bit token table stored once, only "
                       "v_proj at 8 bits (ONNX, onnxruntime-genai; on a .pte the same settings measured over "
                       "the bound)",
                       table_bits=4, int4_8bit_layers=("v_proj",), rounding="gptq", runtimes=("onnx", "onnx-genai"),
                       head_activations="int8"))
