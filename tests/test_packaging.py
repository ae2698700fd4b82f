"""What ``pip install`` puts where: no top-level ``tools``, and the tools' commands work outside
a checkout (the installed package is ``shmloader_tools``, tools/ under another name)."""

import ast
import configparser
import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from arena import stream
from tools import _cli

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("arena", "shmloader", "tools", "setup.cfg", "setup.py", "pyproject.toml", "README.md")


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines() if line.strip()]


def _console_scripts() -> dict[str, str]:
    entries = _lines(_setup_cfg()["options.entry_points"]["console_scripts"])
    return dict(tuple(part.strip() for part in e.split("=")) for e in entries)


def test_setup_cfg_installs_tools_as_shmloader_tools_and_no_top_level_tools():
    options = _setup_cfg()["options"]
    assert _lines(options["packages"]) == ["arena", "shmloader", _cli.INSTALLED_PACKAGE]
    assert _lines(options["package_dir"]) == [f"{_cli.INSTALLED_PACKAGE} = tools"]


def test_each_command_runs_the_main_of_the_tool_it_is_named_for():
    scripts = _console_scripts()
    assert set(scripts) == set(_cli.COMMANDS.values())
    for tool, command in _cli.COMMANDS.items():
        assert scripts[command] == f"{_cli.INSTALLED_PACKAGE}.{tool}:main"
        assert callable(importlib.import_module(f"tools.{tool}").main)


def test_help_names_the_command_installed_and_the_module_in_a_checkout():
    assert _cli.prog("shmloader_tools", "memprof") == "shmloader-memprof"
    assert _cli.prog("tools", "memprof") == "python -m tools.memprof"
    assert _cli.prog("shmloader_tools", "scaling") == "python -m shmloader_tools.scaling"


@pytest.mark.parametrize("path", sorted((REPO / "tools").glob("*.py")), ids=lambda p: p.name)
def test_tools_import_each_other_relatively_so_they_work_under_either_name(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            assert not (node.module or "").startswith("tools"), f"line {node.lineno}"
        if isinstance(node, ast.Import):
            assert all(not a.name.startswith("tools") for a in node.names), f"line {node.lineno}"


def test_the_wheel_holds_arena_shmloader_and_shmloader_tools_and_both_commands(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ behind
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(REPO / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(src)],
        check=True, capture_output=True, timeout=120,
    )
    (wheel,) = (tmp_path / "dist").glob("shmloader-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = z.read(entry_points).decode()
    assert tops == {"arena", "shmloader", "shmloader_tools"}
    assert "shmloader_tools/memprof.py" in names and "shmloader_tools/_memjob.py" in names
    assert "arena/_stream.pyi" in names  # mypy's view of the extension, for users' type checks
    if stream.AVAILABLE:  # built here, so the wheel's own build must have built it too
        assert any(n.startswith("arena/_stream.") and n.endswith(".so") for n in names), names
    for command in _cli.COMMANDS.values():
        assert f"{command} = " in scripts


@pytest.fixture
def installed_layout(tmp_path):
    """A directory that holds the packages as a wheel installs them (tools/ as shmloader_tools,
    no ``tools``), to run from outside the checkout."""
    site = tmp_path / "site"
    site.mkdir()
    for name, target in (("arena", "arena"), ("shmloader", "shmloader"),
                         ("shmloader_tools", "tools")):
        (site / name).symlink_to(REPO / target, target_is_directory=True)
    return site


def _run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120)


def test_installed_memprof_profiles_a_command_outside_a_checkout(installed_layout, tmp_path):
    job = ("import torch, shmloader\n"
           "ds = torch.utils.data.TensorDataset(torch.arange(64.0).reshape(16, 4))\n"
           "loader = shmloader.DataLoader(ds, batch_size=4, num_workers=2)\n"
           "print(sum(b[0].sum().item() for b in loader))\n")
    out = tmp_path / "out"
    done = _run_installed(installed_layout, tmp_path, "shmloader_tools.memprof", "--out",
                          str(out), "--no-plot", "--linger", "1", "--", sys.executable, "-c", job)
    assert done.returncode == 0, done.stderr
    assert "2016.0" in done.stdout
    assert (out / "arena.csv").read_text().count("\n") >= 2  # header and at least one row


def test_installed_memprof_runs_a_built_in_job_from_its_own_package(installed_layout, tmp_path):
    out = tmp_path / "out"
    done = _run_installed(installed_layout, tmp_path, "shmloader_tools.memprof", "--workload",
                          "tabular", "--quick", "--batches", "4", "--no-plot", "--linger", "1",
                          "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "4 batches" in done.stdout


def test_installed_help_names_the_commands(installed_layout, tmp_path):
    for tool, command in _cli.COMMANDS.items():
        done = _run_installed(installed_layout, tmp_path, f"shmloader_tools.{tool}", "--help")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: {command} ")
