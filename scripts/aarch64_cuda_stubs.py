"""Build stand-in shared libraries for the CUDA libraries an aarch64 PyTorch wheel links.

PyPI's aarch64 ``torch`` is a CUDA build: ``import torch`` loads ``libcudart``, ``libcublas``,
``libcudnn`` and a dozen more, which come from about 3 GB of ``nvidia-*`` wheels. ``pit-deploy
verify --isa aarch64`` runs ExecuTorch programs on the CPU only (``scripts/setup_aarch64.sh``), so
each library the wheel's shared objects need and nobody provides is replaced by a small aarch64
library with the same soname that defines every symbol the wheel takes from it, at the symbol
version it asks for. Every function returns 100 (CUDA's "no device" error code) and every data
object is a zeroed block, so PyTorch sees no GPU (``torch.cuda.is_available()`` is false).

Usage::

    python scripts/aarch64_cuda_stubs.py --binutils PREFIX --sysroot SYSROOT --out DIR SITE [SITE ...]

``PREFIX`` is the path prefix of an aarch64 GNU binutils (``…/aarch64-linux-gnu-``: its
``readelf``, ``as`` and ``ld`` are used); ``SYSROOT`` the arm64 root whose libraries count as
provided; every ELF shared object under the ``torch``, ``executorch`` and ``torchao`` packages of
each ``SITE`` counts as a user (and a provider). Standard library only; prints nothing unless it
fails (exit 1 with one line).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

#: the packages whose shared objects are scanned
PACKAGES = ("torch", "executorch", "torchao")
#: what every stand-in function returns (``cudaErrorNoDevice``)
ERROR_CODE = 100
#: bytes of each stand-in data object
OBJECT_BYTES = 256
ELF_MAGIC = b"\x7fELF"


@dataclass
class Elf:
    """What one shared object needs and defines, as ``readelf`` lists it."""

    path: Path
    soname: str | None = None
    needed: list[str] = field(default_factory=list)
    defined: set[str] = field(default_factory=set)
    #: undefined non-weak symbols: ``(name, version or None, type)``
    undefined: list[tuple[str, str | None, str]] = field(default_factory=list)
    #: symbol version -> the library it is needed from
    version_file: dict[str, str] = field(default_factory=dict)


def _readelf(readelf: str, *args: str) -> str:
    return subprocess.run([readelf, "-W", *args], capture_output=True, text=True, check=True).stdout


def read_elf(readelf: str, path: Path) -> Elf:
    elf = Elf(path)
    for line in _readelf(readelf, "-d", str(path)).splitlines():
        m = re.search(r"\((NEEDED|SONAME)\)\s+\S+.*\[(.+)\]", line)
        if m and m.group(1) == "NEEDED":
            elf.needed.append(m.group(2))
        elif m:
            elf.soname = m.group(2)
    current = None
    for line in _readelf(readelf, "-V", str(path)).splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"Name: (\S+)", line)
        if m and current:
            elf.version_file[m.group(1)] = current
    for line in _readelf(readelf, "--dyn-syms", str(path)).splitlines():
        cols = line.split()
        if len(cols) < 8 or not cols[0].rstrip(":").isdigit():
            continue
        typ, bind, ndx, name = cols[3], cols[4], cols[6], cols[7]
        symbol, _, version = name.partition("@")
        version = version.lstrip("@").split()[0] if version else None
        if ndx != "UND":
            elf.defined.add(symbol)
        elif bind != "WEAK" and symbol:
            elf.undefined.append((symbol, version, typ))
    return elf


def is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == ELF_MAGIC
    except OSError:
        return False


def users_of(sites: list[Path]) -> list[Path]:
    found = set()
    for site in sites:
        for package in PACKAGES:
            for path in (site / package).rglob("*.so*"):
                if path.is_file() and not path.is_symlink() and is_elf(path):
                    found.add(path)
    return sorted(found)


def system_libraries(sysroot: Path) -> list[Path]:
    libs = []
    for folder in ("lib/aarch64-linux-gnu", "usr/lib/aarch64-linux-gnu"):
        libs += [p for p in sorted((sysroot / folder).glob("*.so*")) if p.is_file() and is_elf(p)]
    return libs + [p for p in sorted((sysroot / "usr/bin").glob("python3*")) if p.is_file() and is_elf(p)]


def plan(users: list[Elf], system: list[Elf]) -> dict[str, dict[str, tuple[str | None, str]]]:
    """``{missing soname: {symbol: (version, type)}}``: the libraries the users need that neither
    they nor the system provide, with what each must define. An unversioned symbol nobody
    defines goes to the first missing library of the user that needs it."""
    provided = {e.soname or e.path.name for e in users + system} | {e.path.name for e in users + system}
    defined = set().union(*(e.defined for e in users + system))
    missing: dict[str, dict[str, tuple[str | None, str]]] = {}
    for user in users:
        for lib in user.needed:
            if lib not in provided:
                missing.setdefault(lib, {})
    for user in users:
        own_missing = [lib for lib in user.needed if lib in missing]
        for symbol, version, typ in user.undefined:
            lib = user.version_file.get(version) if version else None
            if lib in missing:
                missing[lib][symbol] = (version, typ)
            elif version is None and symbol not in defined and own_missing:
                missing[own_missing[0]].setdefault(symbol, (None, typ))
    return missing


def build(lib: str, symbols: dict[str, tuple[str | None, str]], binutils: str, out: Path, work: Path) -> None:
    asm = [".text"]
    for symbol in sorted(symbols):
        if symbols[symbol][1] == "OBJECT":
            asm += [".data", f".globl {symbol}", f".type {symbol},%object", f".size {symbol},{OBJECT_BYTES}",
                    f"{symbol}:", f".zero {OBJECT_BYTES}", ".text"]
        else:
            asm += [f".globl {symbol}", f".type {symbol},%function", f"{symbol}:", f"mov w0, #{ERROR_CODE}", "ret"]
    source, obj = work / f"{lib}.s", work / f"{lib}.o"
    source.write_text("\n".join(asm) + "\n")
    subprocess.run([binutils + "as", "-o", str(obj), str(source)], check=True, capture_output=True, text=True)
    cmd = [binutils + "ld", "-shared", "-soname", lib, "-o", str(out / lib), str(obj)]
    versions = sorted({v for v, _ in symbols.values() if v})
    if versions:
        plain = sorted(s for s, (v, _) in symbols.items() if v is None)
        nodes = []
        for i, version in enumerate(versions):
            names = sorted(s for s, (v, _) in symbols.items() if v == version) + (plain if i == 0 else [])
            tail = " local: *;" if i == len(versions) - 1 else ""
            nodes.append(f"{version} {{ global: {'; '.join(names)};{tail} }};")
        script = work / f"{lib}.map"
        script.write_text("\n".join(nodes) + "\n")
        cmd[1:1] = ["--version-script", str(script)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binutils", required=True, help="aarch64 binutils prefix (…/aarch64-linux-gnu-)")
    parser.add_argument("--sysroot", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("sites", nargs="+", type=Path)
    args = parser.parse_args(argv)
    readelf = args.binutils + "readelf"
    try:
        users = [read_elf(readelf, p) for p in users_of(args.sites)]
        if not users:
            raise RuntimeError(f"no shared objects of {', '.join(PACKAGES)} under {' '.join(map(str, args.sites))}")
        system = [read_elf(readelf, p) for p in system_libraries(args.sysroot)]
        missing = plan(users, system)
        args.out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for lib, symbols in sorted(missing.items()):
                build(lib, symbols, args.binutils, args.out, Path(tmp))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        said = getattr(exc, "stderr", None) or str(exc)
        print(f"aarch64_cuda_stubs: {said.strip().splitlines()[-1] if said.strip() else exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
