"""Every way a Python process ends, run under one launcher (never collected by pytest).

    python tests/launch/endings.py torchrun|shoal-forked|shoal-no-preload|shoal-torchrun-codes DIR

Writes SCRIPT_DIR/ends.py, a script that ends in the way its first argument names, on
rank 1 only ("one") or on every rank ("all"), and runs it under the launcher once per
ending and scope, here, one launch after another: the launcher's own ``main`` is called in
this process, so that its import and (for shoal) its workers' server are paid once. Each
launch's exit status is what the command would exit with: shoal's ``main`` returns it;
torchrun's ``main`` returns for 0 and raises for a failure, which the interpreter turns into
1. Prints one JSON line: {"ENDING/SCOPE": status}. ``shoal-forked`` forks every attempt's
workers from the preloaded server, the first one's too, as a live replica group does (a
job's first workers are otherwise new processes, and only restarted ones are forked).
``shoal-torchrun-codes`` runs with ``--torchrun-exit-codes``, on rank 1 only.
"""

import json
import os
import sys

ENDINGS = {
    "return": "pass",
    "sys.exit()": "sys.exit()",
    "sys.exit(None)": "sys.exit(None)",
    "sys.exit(0)": "sys.exit(0)",
    "sys.exit(3)": "sys.exit(3)",
    "sys.exit('message')": "sys.exit('the script gave up')",
    "exit()": "exit()",
    "raise SystemExit": "raise SystemExit",
    "os._exit(0)": "os._exit(0)",
    "os._exit(5)": "os._exit(5)",
    "exception": "raise ValueError('injected')",
    "signal": "os.kill(os.getpid(), signal.SIGKILL)",
}

SCRIPT = """\
import os, signal, sys
ending, scope = sys.argv[1], sys.argv[2]
print(f"rank {os.environ['RANK']} ends by {ending}")
if scope == "all" or os.environ["RANK"] == "1":
""" + "".join(f"    if ending == {name!r}:\n        {code}\n" for name, code in ENDINGS.items())


def _torchrun(argv: list[str]) -> int:
    from torch.distributed.run import main

    try:
        main(argv)
    except SystemExit as exc:  # argparse
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - what `torchrun` exits with for any exception
        return 1
    return 0


def _shoal(argv: list[str]) -> int:
    from shoal.cli.main import main

    return main(["run", *argv])


def main() -> None:
    launcher, folder = sys.argv[1], sys.argv[2]
    script = os.path.join(folder, "ends.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    run = _torchrun if launcher == "torchrun" else _shoal
    flags = {"shoal-no-preload": ["--no-preload"],
             "shoal-torchrun-codes": ["--torchrun-exit-codes"]}.get(launcher, [])
    if launcher == "shoal-forked":
        from shoal.launch.worker_start import FORK_FIRST_ENV

        os.environ[FORK_FIRST_ENV] = "1"
    statuses = {}
    # (--torchrun-exit-codes changes only the launcher's own status: one rank is enough)
    scopes = ("one",) if launcher == "shoal-torchrun-codes" else ("one", "all")
    for ending in ENDINGS:
        for scope in scopes:
            statuses[f"{ending}/{scope}"] = run(["--nproc-per-node", "2", *flags, script,
                                                 ending, scope])
    sys.stdout.flush()
    print(json.dumps(statuses))


if __name__ == "__main__":
    main()
