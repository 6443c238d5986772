"""``orchard agent bundle --out DIR``: a relocatable, self-contained exec agent.

Layout::

    DIR/bin/orchard-agent        static launcher (the only entry point)
    DIR/bin/orchard-enter        static helper every command goes through
    DIR/lib/                     the loader, libc and every shared library below needs
    DIR/python/bin/python3.X     the interpreter this command runs on
    DIR/python/lib/python3.X/    its standard library (trimmed) and site-packages: the
                                 agent's dependency closure and the `orchard` agent code
    DIR/orchard-bundle.json      manifest: inputs, and every file's size, mode and sha256

Built from what is installed here (a CPython from python.org, pyenv or Debian, and wheels
from PyPI), never downloaded. Bytecode is compiled with unchecked hashes (no timestamps),
file modes are normalized and nothing records the build time or the output path, so the
same inputs give the same manifest.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Iterable, Iterator

from packaging.requirements import Requirement

import orchard
from orchard.agent.runtimes.helper import SOURCE as ENTER_SOURCE, compile_static
from orchard.bundle.manifest import write_manifest
from orchard.errors import InvalidRequest, RuntimeUnavailable

LAUNCHER_SOURCE = Path(__file__).with_name("launcher.c")
AGENT_REQUIREMENTS = ("fastapi", "uvicorn", "httptools", "pluggy", "pydantic")
# What the agent never imports: test suites, GUIs, build tools, other installers.
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "site-packages",
               "distutils", "venv", "__pycache__", "__phello__"}
DYNLOAD_SKIP = re.compile(r"^(_tkinter|_curses|_curses_panel|readline|nis|_dbm|_gdbm|_sqlite3|xxlimited|xxsubtype|"
                          r"_xxtestfuzz|_ctypes_test|_test\w*|_xxsubinterpreters)\.")
ORCHARD_SKIP = {"train", "bench", "testing", "cli", "server", "bundle", "__pycache__"}
KEEP_LIBS_UNSTRIPPED = re.compile(r"^(ld-linux.*|libc\.so.*)$")


def requirement_closure(roots: Iterable[str]) -> dict[str, metadata.Distribution]:
    """Installed distributions the roots need, following requirements (no extras)."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise RuntimeUnavailable(f"the agent needs {name!r}, which is not installed here") from None
        key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if key in found:
            continue
        found[key] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    os.chmod(target, 0o755 if os.access(source, os.X_OK) and not source.suffix == ".py" else 0o644)


def _walk(root: Path, skip: set[str]) -> Iterator[Path]:
    for path in sorted(root.iterdir()):
        if path.name in skip or path.is_symlink() and path.is_dir():
            continue
        if path.is_dir():
            yield from _walk(path, skip)
        elif path.suffix not in (".pyc", ".pyo"):
            yield path


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == b"\x7fELF"


def shared_libraries(elf_files: Iterable[Path]) -> tuple[dict[str, Path], str]:
    """Every library the files load (by the name they ask for) and the loader's name, from ldd."""
    libraries: dict[str, Path] = {}
    loader = ""
    for path in elf_files:
        result = subprocess.run(["ldd", str(path)], capture_output=True, text=True)
        if "statically linked" in result.stdout or "not a dynamic executable" in result.stderr:
            continue
        for line in result.stdout.splitlines():
            line = line.strip()
            if "=>" in line:
                name, _, rest = line.partition("=>")
                location = rest.split("(")[0].strip()
                if location == "not found":
                    raise RuntimeUnavailable(f"{path} needs {name.strip()}, which is not installed here")
                if location:
                    libraries[name.strip()] = Path(location)
            elif line.startswith("/"):
                found = Path(line.split("(")[0].strip())
                loader = found.name
                libraries[found.name] = found
    if not loader:
        raise RuntimeUnavailable("could not find the dynamic loader of this Python")
    return libraries, loader


def _strip(path: Path) -> None:
    if shutil.which("strip") and not KEEP_LIBS_UNSTRIPPED.match(path.name):
        subprocess.run(["strip", "--strip-unneeded", str(path)], check=True, capture_output=True)


# Run by the bundle's own Python with -S: it imports nothing beyond the frozen bootstrap,
# because marshal's output for a module depends on the reference counts of the strings it
# shares with modules already loaded (compileall's own imports made pycs differ run to run).
_COMPILER = """\
import _imp, sys
from importlib import _bootstrap_external as ext
root = sys.argv[1]
for line in sys.stdin.read().splitlines():
    source = open(line, "rb").read()
    code = compile(source, "/" + line[len(root):].lstrip("/"), "exec", dont_inherit=True)
    data = ext._code_to_hash_pyc(code, _imp.source_hash(ext._RAW_MAGIC_NUMBER, source), False)
    target = ext.cache_from_source(line)
    ext._path_isdir(target.rpartition("/")[0]) or __import__("os").mkdir(target.rpartition("/")[0])
    open(target, "wb").write(data)
    del code
"""


def _compile_bytecode(bundle: Path, loader: str, python: Path, tree: Path) -> None:
    """Bytecode beside the sources (unchecked hashes, no timestamps), so a read-only bundle
    starts fast. Compiled in a fresh process with a fixed hash seed; the paths inside are
    relative to the bundle (Python fixes them to the real location on import)."""
    sources = "".join(f"{path}\n" for path in sorted(tree.rglob("*.py")))
    argv = [str(bundle / "lib" / loader), "--inhibit-cache", "--library-path", str(bundle / "lib"), str(python),
            "-S", "-s", "-c", _COMPILER, str(bundle)]
    result = subprocess.run(argv, input=sources, env={"PYTHONHASHSEED": "0"}, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeUnavailable(f"compiling the bundle's bytecode failed:\n{result.stderr[-3000:]}")


def build_bundle(out: Path, force: bool = False) -> dict:
    """Build the bundle into ``out`` (replaced whole when ``force``); returns the manifest."""
    out = out.absolute()
    if out.exists() and any(out.iterdir()) and not force:
        raise InvalidRequest(f"{out} exists and is not empty (use --force to replace it)")
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(sys.base_prefix)
    interpreter = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    stdlib_source = Path(sysconfig.get_paths(vars={"base": str(base), "platbase": str(base)})["stdlib"])
    if not (stdlib_source / "os.py").is_file():
        raise RuntimeUnavailable(f"this Python's standard library is not at {stdlib_source}")

    work = Path(tempfile.mkdtemp(prefix=".orchard-bundle-", dir=out.parent))
    try:
        python_bin = work / "python" / "bin" / version
        stdlib = work / "python" / "lib" / version
        site = stdlib / "site-packages"
        _copy(interpreter, python_bin)
        for path in _walk(stdlib_source, STDLIB_SKIP | {p.name for p in stdlib_source.glob("config-*")}):
            relative = path.relative_to(stdlib_source)
            if relative.parts[0] == "lib-dynload" and DYNLOAD_SKIP.match(path.name):
                continue
            _copy(path, stdlib / relative)
        distributions = requirement_closure(AGENT_REQUIREMENTS)
        for dist in distributions.values():
            for file in dist.files or []:
                source = Path(dist.locate_file(file))
                if "__pycache__" in file.parts or file.suffix == ".pyc" or not source.is_file():
                    continue
                if ".." in file.parts:  # scripts installed outside site-packages
                    continue
                _copy(source, site / file)
        orchard_source = Path(orchard.__file__).parent
        for path in _walk(orchard_source, ORCHARD_SKIP):
            _copy(path, site / "orchard" / path.relative_to(orchard_source))

        elf_files = [p for p in sorted(work.rglob("*")) if p.is_file() and _is_elf(p)]
        libraries, loader = shared_libraries(elf_files)
        for name, source in sorted(libraries.items()):
            _copy(Path(os.path.realpath(source)), work / "lib" / name)
        for path in elf_files + [work / "lib" / name for name in libraries]:
            _strip(path)

        arch = platform.machine()
        (work / "bin").mkdir()
        compile_static(LAUNCHER_SOURCE, work / "bin" / "orchard-agent", f'-DBUNDLE_ARCH="{arch}"',
                       f'-DBUNDLE_LOADER="{loader}"', f'-DBUNDLE_PYTHON="python/bin/{version}"')
        compile_static(ENTER_SOURCE, work / "bin" / "orchard-enter")
        _compile_bytecode(work, loader, python_bin, stdlib)

        inputs = {
            "arch": arch,
            "python": platform.python_version(),
            "orchard": orchard.__version__,
            "loader": loader,
            "distributions": {key: dist.version for key, dist in sorted(distributions.items())},
            "libraries": {name: str(source) for name, source in sorted(libraries.items())},
        }
        manifest = write_manifest(work, inputs)
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
        os.chmod(out, 0o755)
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)
