"""What the cluster tests read of the Ray a command started: its processes, by the session of its head (the head's
process group; Ray's workers take process groups of their own but keep the session), read from /proc."""

import os
from pathlib import Path


def session_processes(session: int) -> dict[int, str]:
    """{pid: command name} of the live processes (zombies left out) of `session` (> 1)."""
    assert session > 1, session
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()
        if rest[0] != "Z" and int(rest[3]) == session:
            found[int(entry.name)] = comm
    return found


def clean_env(home: Path) -> dict[str, str]:
    """This process's environment as a fresh machine has it for Ray: HOME an empty folder, no RAY_* variable."""
    home.mkdir(parents=True, exist_ok=True)
    assert not any(home.iterdir()), home
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)
    return env
