"""How a tool names itself in ``--help`` and usage lines: the way the user started it.

In a checkout the tools are the package ``tools`` (``python -m tools.bench``). Installed, the same
modules are the package ``shmloader_tools`` (setup.cfg's ``package_dir``: no top-level ``tools``
lands in site-packages), and the tools users need outside a checkout are commands (setup.cfg's
``console_scripts``, which must match :data:`COMMANDS`).
"""

from __future__ import annotations

CHECKOUT_PACKAGE = "tools"
INSTALLED_PACKAGE = "shmloader_tools"
# tool module -> installed command
COMMANDS = {"bench": "shmloader-bench", "memprof": "shmloader-memprof"}


def prog(package: str | None, tool: str) -> str:
    """``shmloader-<tool>`` when installed and a command, else ``python -m <package>.<tool>``."""
    if package != CHECKOUT_PACKAGE and tool in COMMANDS:
        return COMMANDS[tool]
    return f"python -m {package or CHECKOUT_PACKAGE}.{tool}"
