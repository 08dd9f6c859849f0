"""The mutation gate: plant each bug of ``tests/mutants/catalog.py`` in a scratch copy of the repository, run
the tests that must catch it, and fail when any survives.

    python tools/mutants.py                 # every mutant (exit 1 on a survivor or a broken entry)
    python tools/mutants.py --only NAME ... # some of them
    python tools/mutants.py --list
    python tools/mutants.py --jobs 2        # two at once (one scratch copy each)

The working tree is never touched: its files (tracked and untracked, not ignored) are copied to a
temporary directory once, each mutant is written there, its tests run with pytest from that copy (forked
off a process that imported the third-party libraries once: tools/preloaded_pytest.py), and the original
line is written back. Before any mutant, the catching tests run once
on the unmutated copy and must pass: a test that fails anyway would "catch" every mutant.

A mutant counts as caught when pytest reports failing tests or a collection error (exit 1 or 2); exit 0
is a survivor; any other exit (a node id that no longer exists, nothing collected) is a broken entry.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.mutants.catalog import MUTANTS, Mutant, catalog_problems  # noqa: E402
from tools.preloaded_pytest import PreloadedPytest  # noqa: E402

# Each scratch copy's pytest server (tools/preloaded_pytest.py), started with the copy.
RUNNERS: dict[Path, PreloadedPytest] = {}

# A hang guard only: the slowest honest mutant run is well under a minute on 2 CPU cores.
HANG_GUARD_S = 900


def scratch_copy(destination: Path) -> Path:
    """The repository's files (tracked and untracked, not ignored) under ``destination``, with the
    package-dir mappings of pyproject.toml linked into the package so the copy imports only itself."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    # The editable install maps lightning_drafts.callbacks (and .datamodules) to the working tree's
    # folders; linked inside the copy's package, the copy's own folders are found first.
    for package, folder in package_dirs(ROOT / "pyproject.toml").items():
        link = destination / Path(*package.split("."))
        if not link.exists():
            link.symlink_to(destination / folder, target_is_directory=True)
    return destination


def package_dirs(pyproject: Path) -> dict[str, str]:
    """The ``[tool.setuptools.package-dir]`` table (``"package" = "folder"`` lines; tomllib is 3.11+)."""
    mapping, inside = {}, False
    for line in pyproject.read_text().splitlines():
        if line.startswith("["):
            inside = line.strip() == "[tool.setuptools.package-dir]"
        elif inside and "=" in line:
            package, folder = (part.strip().strip('"') for part in line.split("=", 1))
            mapping[package] = folder
    return mapping


def environment(copy: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def check_imports_from(copy: Path) -> None:
    """Refuse to run when the copy would import the working tree's code (a mutant there is never seen)."""
    probe = (
        "import lightning_drafts, lightning_drafts.workflows.served_acceptance as c, tests;"
        "print(lightning_drafts.__file__); print(c.__file__); print(tests.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=copy, env=environment(copy), capture_output=True, text=True
    )
    files = out.stdout.split()
    if out.returncode != 0 or len(files) != 3 or not all(Path(f).is_relative_to(copy) for f in files):
        raise SystemExit(
            f"the scratch copy at {copy} does not import its own code ({files or out.stderr.strip()}); "
            "reinstall the project (pip install -e .) and run again"
        )


def run_tests(copy: Path, tests: tuple[str, ...] | list[str]) -> tuple[int, str]:
    """``pytest -x`` of ``tests`` from ``copy``, forked off the copy's preloaded server (its third-party
    imports done once, not once per mutant), in that process (``-n 0``: the gate runs mutants side by side
    already, and a worker pool per mutant would import everything again)."""
    rc, output = RUNNERS[copy].run(
        copy, ["-x", "-q", "-p", "no:cacheprovider", "-n", "0", *tests], HANG_GUARD_S
    )
    if rc == -1:
        return -1, f"no result within {HANG_GUARD_S} s"
    return rc, output.strip()


def plant(copy: Path, mutant: Mutant) -> str:
    """Write the mutant into the copy; return the file's original text (to write back)."""
    path = copy / mutant.file
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    (index,) = [i for i, line in enumerate(lines) if line.strip() == mutant.original.strip()]
    line = lines[index]
    indent = line[: len(line) - len(line.lstrip())]
    ending = line[len(line.rstrip("\r\n")) :]
    lines[index] = indent + mutant.mutated.strip() + ending
    path.write_text("".join(lines))
    return text


def run_mutant(copies: queue.Queue[Path], mutant: Mutant) -> int:
    """Plant ``mutant`` in a free copy, run its tests, write the original back; print and return the exit."""
    copy = copies.get()
    began = time.monotonic()
    original = plant(copy, mutant)
    try:
        rc, output = run_tests(copy, mutant.tests)
    finally:
        (copy / mutant.file).write_text(original)
        copies.put(copy)
    verdict = {0: "SURVIVED", 1: "caught", 2: "caught (collection error)", -1: "caught (hang)"}.get(
        rc, f"BROKEN ENTRY (pytest exit {rc})"
    )
    tail = f"\n{output[-2000:]}" if verdict.startswith("BROKEN") else ""
    print(f"{verdict:<28} {mutant.name}  ({time.monotonic() - began:.0f} s){tail}", flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the tests")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs} must be at least 1")

    problems = catalog_problems(ROOT)
    if problems:
        print("the mutant catalog is broken:", *problems, sep="\n  ")
        return 1
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    unknown = sorted(set(args.only or ()) - {m.name for m in MUTANTS})
    if unknown:
        print(f"no mutant named {unknown}; --list shows them")
        return 2
    if args.list:
        for mutant in mutants:
            print(f"{mutant.name}: {mutant.file}: {mutant.why}")
        return 0

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutants-") as scratch:
        # One scratch copy per worker: a mutant is planted in its worker's copy only.
        copies: queue.Queue[Path] = queue.Queue()
        for worker in range(args.jobs):
            copy = scratch_copy(Path(scratch) / str(worker))
            check_imports_from(copy)
            RUNNERS[copy] = PreloadedPytest(environment(copy))
            copies.put(copy)
        if not args.no_baseline:
            tests = list(dict.fromkeys(test for m in mutants for test in m.tests))
            copy = copies.get()
            rc, output = run_tests(copy, tests)
            copies.put(copy)
            print(f"baseline: {len(tests)} test ids on the unmutated copy: exit {rc}", flush=True)
            if rc != 0:
                print(output[-4000:])
                print("the catching tests must pass before any mutant is planted")
                return 1
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda m: run_mutant(copies, m), mutants))
        for runner in RUNNERS.values():
            runner.close()
    survivors = [m for m, rc in zip(mutants, results, strict=True) if rc == 0]
    broken = [m for m, rc in zip(mutants, results, strict=True) if rc not in (0, 1, 2, -1)]
    total = time.monotonic() - start
    print(
        f"{len(mutants)} mutants: {len(mutants) - len(survivors) - len(broken)} caught, "
        f"{len(survivors)} survived, {len(broken)} broken entries; {total:.0f} s"
    )
    for mutant in survivors:
        print(f"  survivor: {mutant.name} ({mutant.file}: {mutant.why}); tests: {', '.join(mutant.tests)}")
    return 1 if survivors or broken else 0


if __name__ == "__main__":
    sys.exit(main())
