"""Runs one of the repository's scripts as `python SCRIPT ARGS...` would and, when it exits (an error's exit
included), writes the names of the modules it loaded to OUT, one a line, and the argv of each process it started
through `subprocess` to OUT.processes, one JSON list a line:

    python tests/helpers/modules_at_exit.py OUT retrieve.py --index W --query doc.txt
"""

import atexit
import json
import runpy
import sys
from pathlib import Path


def main() -> None:
    out, script, *args = sys.argv[1:]
    started = []
    sys.addaudithook(lambda event, args: started.append([str(a) for a in args[1]])
                     if event == "subprocess.Popen" else None)
    atexit.register(lambda: Path(out).write_text("\n".join(sorted(sys.modules)) + "\n"))
    atexit.register(lambda: Path(out + ".processes").write_text("".join(json.dumps(a) + "\n" for a in started)))
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python SCRIPT` puts the script's folder first
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
