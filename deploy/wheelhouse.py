"""Build a wheelhouse: loraserve's wheel and every wheel it needs, for a host that has no package index.

TPU VMs in locked-down projects, air-gapped clusters and sandboxes often reach no package index at all. This
script runs where pip does reach one (any machine, any CPU: it downloads, it installs nothing) and fills a
folder that the offline host installs from::

    python deploy/wheelhouse.py --extras tpu,registry --out wheelhouse          # `make wheelhouse`
    # on the offline host (Python 3.11, x86-64 Linux by default):
    pip install --no-index --find-links wheelhouse 'loraserve[tpu,registry]'

It resolves ``loraserve[EXTRAS]`` for the *target* interpreter and platform (``--python``, ``--platform``:
pip's own resolver with ``--dry-run --report``, binary wheels only), then downloads each resolved wheel with
``--no-deps``. ``--skip`` leaves out distributions the host already has (a TPU image ships JAX, jaxlib,
libtpu and numpy; leaving them out keeps the folder small), ``--with`` adds requirements beside the extras
(e.g. ``pytest-timeout`` for ``make test-tpu``). The folder also gets ``requirements.txt`` (every resolved
``name==version``, skipped ones marked) and the loraserve wheel itself, built from this checkout (generate
the protos first: ``make protos``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# pip matches manylinux tags exactly: name every glibc up to the target's (2.35 covers Debian 12 / Ubuntu 22.04
# hosts and every wheel built for older ones)
DEFAULT_PLATFORMS = (
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _target_args(python: str, platforms: list[str]) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for platform in platforms:
        args += ["--platform", platform]
    return args


# what building the wheel does not read: copied around, not into the build's source folder
NOT_SOURCE = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", ".demo",
              ".cache", ".whl-*", "wheelhouse", "device-out")  # fmt: skip


def build_project_wheel(out: Path) -> Path:
    """loraserve's own wheel from this checkout, into ``out``. Built from a copy of the sources: setuptools
    stages files in the source folder's ``build/`` and never deletes stale ones, and another build of the
    checkout (a test's) may be using that folder at the same time."""
    if not (ROOT / "protos" / "v1" / "inference_pb2.py").exists():
        raise SystemExit("the generated protos are missing: run `make protos` first")
    with tempfile.TemporaryDirectory(prefix="wheelhouse-src-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE), symlinks=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
            check=True,
        )  # fmt: skip
    (wheel,) = sorted(out.glob("loraserve-*.whl"))
    return wheel


def stale_files(site: Path, root: Path = ROOT) -> list[str]:
    """The Python files in which the loraserve installed under ``site`` differs from the checkout at ``root``
    (changed, or on one side only), named as in the checkout; generated gRPC modules are not compared.

    A TPU host runs the suite against the installed package (tests/tpu.sh), so a wheelhouse built before the
    last change would test yesterday's code: ``bench/tpu_session.sh install`` stops on any of these."""
    import tomllib

    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    # the longest dotted package first: loraserve.worker's files are under worker/, not loraserve/worker/
    mapping = sorted(
        ((pkg.split("."), Path(folder)) for pkg, folder in dirs.items()), key=lambda m: -len(m[0])
    )
    installed, checkout = {}, {}
    for path in (site / "loraserve").rglob("*.py"):
        parts = path.relative_to(site).with_suffix("").parts
        for pkg, folder in mapping:
            if list(parts[: len(pkg)]) == pkg:
                installed[(folder / Path(*parts[len(pkg) :])).with_suffix(".py").as_posix()] = path
                break
    for _pkg, folder in mapping:
        for path in (root / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                checkout[path.relative_to(root).as_posix()] = path
    generated = re.compile(r"_pb2(_grpc)?\.py$")
    return sorted(
        name
        for name in installed.keys() | checkout.keys()
        if not generated.search(name)
        and (
            name not in installed
            or name not in checkout
            or installed[name].read_bytes() != checkout[name].read_bytes()
        )
    )


def resolve(requirements: list[str], python: str, platforms: list[str], pip_args: list[str]) -> list[dict]:
    """``[{name, version, url}]``: what pip would install for ``requirements`` on the target."""
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [
                sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
                "--target", str(Path(tmp) / "target"), "--report", str(report),
                *_target_args(python, platforms), *pip_args, *requirements,
            ],
            check=True,
        )  # fmt: skip
        installs = json.loads(report.read_text())["install"]
    return [
        {
            "name": canonical(item["metadata"]["name"]),
            "version": item["metadata"]["version"],
            "url": item["download_info"]["url"],
        }
        for item in installs
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "wheelhouse", help="the folder to fill (created)")
    parser.add_argument("--extras", default="tpu,registry", help="loraserve's extras, comma-separated")
    parser.add_argument("--with", dest="extra_reqs", default="", help="more requirements, comma-separated")
    parser.add_argument("--skip", default="", help="distributions the host already has, comma-separated")
    parser.add_argument("--python", default="3.11", help="the target's Python version (default 3.11)")
    parser.add_argument(
        "--platform",
        action="append",
        help="a wheel platform tag of the target (repeat; default x86-64 Linux)",
    )
    parser.add_argument("--pip-arg", action="append", default=[], help="passed to pip (e.g. --index-url=URL)")
    parser.add_argument(
        "--project-only",
        action="store_true",
        help="rebuild only loraserve's own wheel in --out (after a change)",
    )
    parser.add_argument(
        "--compare-installed",
        type=Path,
        metavar="SITE",
        help="only say which of the checkout's Python files differ from loraserve installed under SITE (exit 1 if any)",
    )
    args = parser.parse_args(argv)
    if args.compare_installed:
        stale = stale_files(args.compare_installed)
        for name in stale:
            print(f"differs from the checkout: {name}")
        return 1 if stale else 0
    if args.project_only:
        for old in args.out.glob("loraserve-*.whl"):
            old.unlink()
        print(f"wheelhouse {args.out}: {build_project_wheel(args.out).name} rebuilt")
        return 0
    platforms = args.platform or list(DEFAULT_PLATFORMS)
    skip = {canonical(s) for s in args.skip.split(",") if s.strip()}
    args.out.mkdir(parents=True, exist_ok=True)

    project = build_project_wheel(args.out)
    extras = ",".join(e.strip() for e in args.extras.split(",") if e.strip())
    requirements = [f"loraserve[{extras}] @ {project.resolve().as_uri()}" if extras else str(project)]
    requirements += [r.strip() for r in args.extra_reqs.split(",") if r.strip()]
    resolved = [
        r for r in resolve(requirements, args.python, platforms, args.pip_arg) if r["name"] != "loraserve"
    ]

    wanted = [r for r in resolved if r["name"] not in skip]
    if wanted:
        subprocess.run(
            [
                sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(args.out),
                *_target_args(args.python, platforms), *args.pip_arg,
                *(f"{r['name']}=={r['version']}" for r in wanted),
            ],
            check=True,
        )  # fmt: skip
    lines = [
        f"{r['name']}=={r['version']}" + ("  # skipped: the host has it" if r["name"] in skip else "")
        for r in sorted(resolved, key=lambda r: r["name"])
    ]
    (args.out / "requirements.txt").write_text("\n".join(lines) + "\n")
    size = sum(p.stat().st_size for p in args.out.glob("*.whl")) / 2**20
    print(
        f"wheelhouse {args.out}: {project.name} and {len(wanted)} wheels ({size:.1f} MiB); "
        f"{len(resolved) - len(wanted)} skipped. Install offline with:\n"
        f"  pip install --no-index --find-links {args.out} 'loraserve[{extras}]'"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
