"""torchrun's command line, as `shoal run` (and every command that launches) takes it.

A command line written for torchrun runs unchanged: each flag in both of torchrun's
spellings (``--nproc-per-node`` and ``--nproc_per_node``), torchrun's flags that shoal has
no other name for (``--standalone``, ``--rdzv-backend``, ``--rdzv-conf``, ``--role``,
``--tee``, ...), each with torchrun's meaning, and the ``PET_*`` environment variables that
stand for flags (``PET_MAX_RESTARTS``; those of the job's shape, ``PET_NNODES`` and the
rest that Kubeflow's PyTorchJob sets, are read by the scheduler detection). What shoal
does not support is refused in one line that says what to use instead.
"""

from __future__ import annotations

import argparse
import os

from shoal.errors import UsageError
from shoal.launch.config import AgentOptions

_STREAMS = "0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local rank: 0:1,1:2"


def underscored(flag: str) -> str:
    """torchrun's other spelling of ``flag``: ``--nproc-per-node`` -> ``--nproc_per_node``."""
    return "--" + flag[2:].replace("-", "_")


def flag(parser, name: str, *more: str, **kwargs) -> None:
    """A flag in shoal's spelling and torchrun's other one, which ``--help`` leaves out."""
    spellings = [name, *more]
    if underscored(name) != name:
        spellings.append(underscored(name))
    parser.add_argument(*spellings, **kwargs)


def _comma_list(value: str) -> list[str]:
    return [item for item in value.split(",") if item]


def add_torchrun_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of torchrun's that shoal takes as torchrun does and has no own name for."""
    group = parser.add_argument_group(
        "torchrun's flags", "taken with torchrun's meaning; every flag also takes "
        "torchrun's spelling with underscores (--nproc_per_node)")
    flag(group, "--standalone", action="store_true",
         help="one node, with a rendezvous store of its own on a free port (shoal's default "
         "on one node); --rdzv-* and --master-* are then ignored")
    flag(group, "--rdzv-backend", default=None, metavar="c10d|static",
         help="c10d (with --rdzv-endpoint) or static (with --master-addr/--master-port; "
         "default without --rdzv-endpoint)")
    flag(group, "--rdzv-conf", default=None, metavar="KEY=VALUE,...",
         help="rendezvous settings, e.g. join_timeout=600,last_call_timeout=30,is_host=1")
    flag(group, "--monitor-interval", type=float, default=None, metavar="SECONDS",
         help="how often the workers' state is checked (default 0.1)")
    flag(group, "--start-method", choices=["spawn", "fork", "forkserver"], default=None,
         help="as under torchrun, how a worker run as a function starts: a script's workers "
         "are not started by it (see --no-preload)")
    flag(group, "--event-log-handler", default=None, metavar="NAME",
         help="torch.distributed.elastic's event handler (default null)")
    flag(group, "--role", default=None, help="the workers' role name (ROLE_NAME; default "
         "'default')")
    flag(group, "--redirects", "-r", default=None, metavar="STREAMS",
         help=f"streams only written to the per-rank logs, not shown: {_STREAMS}")
    flag(group, "--tee", "-t", default=None, metavar="STREAMS",
         help=f"streams shown as well as logged (shoal shows both by default): {_STREAMS}")
    flag(group, "--log-line-prefix-template", default=None, metavar="TEMPLATE",
         help="the prefix of each shown line, with ${rank}, ${local_rank}, ${role_name} and "
         "${hostname} substituted (default '[rank${rank}]: '; also "
         "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)")
    flag(group, "--print-completion", default=None, metavar="SHELL",
         help="not supported: shoal prints no shell completion script (torchrun's needs the "
         "shtab package)")
    flag(group, "--local-ranks-filter", default=None, metavar="0,1,...",
         help="show only these local ranks' output (the others' still go to the logs)")
    flag(group, "--duplicate-stdout-filters", type=_comma_list, default=None,
         metavar="TEXT,...", help="also copy stdout lines holding one of these to a file")
    flag(group, "--duplicate-stderr-filters", type=_comma_list, default=None,
         metavar="TEXT,...", help="also copy stderr lines holding one of these to a file")
    flag(group, "--local-addr", default=None, metavar="ADDRESS",
         help="this node's address as the others reach it (default: found by shoal)")
    flag(group, "--logs-specs", default=None, metavar="NAME",
         help="a LogsSpecs of the entry point group torchrun.logs_specs, for where the "
         "per-rank logs go")
    flag(group, "--numa-binding", default=None,
         choices=["node", "socket", "exclusive", "core-complex"],
         help="bind each GPU worker to the CPUs and memory near its GPU")
    flag(group, "--signals-to-handle", default=None, metavar="SIGTERM,...",
         help="signals passed on to the workers (default SIGTERM,SIGINT,SIGHUP,SIGQUIT,"
         "SIGUSR1)")
    flag(group, "--shutdown-timeout", type=int, default=None, metavar="SECONDS",
         help="how long stopped workers get between SIGTERM and SIGKILL (default 60)")
    flag(group, "--virtual-local-rank", action="store_true",
         help="every worker sees LOCAL_RANK 0 and only its own GPU")


def add_script_arguments(parser: argparse.ArgumentParser) -> None:
    """torchrun's flags about the entry that only `shoal run` has."""
    flag(parser, "--no-python", action="store_true",
         help="run ENTRY as a program of its own, not a Python script (no rank bootstrap: "
         "failures are told by exit status only)")
    flag(parser, "--run-path", action="store_true",
         help="as under torchrun, run the script with runpy.run_path: what shoal does anyway")


# Read by shoal's scheduler detection instead (shoal.clusters.detect: Kubeflow's PyTorchJob
# sets them), with its checks and its one line about what it found.
_DETECTED = frozenset({"nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port",
                       "rdzv_endpoint", "rdzv_id", "rdzv_backend", "rdzv_conf", "standalone"})


def pet_defaults(parser: argparse.ArgumentParser) -> None:
    """Defaults from torchrun's ``PET_<FLAG>`` variables (``PET_MAX_RESTARTS=3``); those of
    the job's shape and rendezvous are the scheduler detection's."""
    for action in parser._actions:
        if not action.option_strings or action.dest in _DETECTED | {"help", "preload"}:
            continue
        value = os.environ.get(f"PET_{action.dest.upper()}")
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            parser.set_defaults(**{action.dest: value.lower() not in ("0", "false", "")})
        else:  # argparse applies the flag's type to a default given as text
            parser.set_defaults(**{action.dest: value})


def _parse_conf(text: str | None) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--rdzv-conf takes KEY=VALUE,..., got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def apply_torchrun_rendezvous(args: argparse.Namespace) -> None:
    """Turn ``--standalone``, ``--rdzv-backend`` and ``--rdzv-conf`` into shoal's own
    rendezvous flags, as torchrun reads them."""
    if getattr(args, "print_completion", None) is not None:
        raise UsageError("--print-completion: shoal prints no shell completion script; "
                         "`shoal run --help` lists every flag")
    if getattr(args, "standalone", False):
        if args.nnodes not in (None, "1", "1:1"):
            raise UsageError(f"--standalone runs on one node, not --nnodes {args.nnodes}")
        args.nnodes = args.rdzv_endpoint = args.rdzv_id = None
        args.master_addr = args.master_port = None
        args.rdzv_backend = None
    backend = getattr(args, "rdzv_backend", None)
    if backend not in (None, "c10d", "static"):
        raise UsageError(f"--rdzv-backend {backend}: shoal meets through torch's own store: "
                         "use --rdzv-backend c10d with --rdzv-endpoint HOST:PORT (any node "
                         "hosts it), or static rendezvous with --master-addr/--master-port")
    if backend == "static" and args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"--rdzv-endpoint must be HOST:PORT, got {args.rdzv_endpoint!r}")
        args.master_addr = args.master_addr or host
        args.master_port = args.master_port if args.master_port is not None else int(port)
        args.rdzv_endpoint = None
    if backend == "c10d" and args.rdzv_endpoint and not args.rdzv_id:
        args.rdzv_id = "none"  # torchrun's default run id
    conf = _parse_conf(getattr(args, "rdzv_conf", None))
    if "last_call_timeout" in conf:
        args.rdzv_last_call = float(conf.pop("last_call_timeout"))
    if "is_host" in conf:
        args.rdzv_host = conf.pop("is_host").lower() in ("1", "true", "yes")
    args.rdzv_extra = conf


def _prefix_template(args: argparse.Namespace) -> str:
    """The flag, else the variable, else shoal's default; as under torchrun, an empty one
    (given or set) means no prefix."""
    for given in (getattr(args, "log_line_prefix_template", None),
                  os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")):
        if given is not None:
            return given
    return AgentOptions.log_line_prefix_template


def agent_options(args: argparse.Namespace) -> AgentOptions:
    """The elastic agent's settings that torchrun's flags give, passed on as given (a
    replica group's launcher: those of the live job's flags)."""
    given = AgentOptions.from_environ()
    if given is not None:
        return given

    def get(name: str, default=None):
        value = getattr(args, name, None)
        return default if value is None else value

    return AgentOptions(
        role=get("role", "default"),
        event_log_handler=get("event_log_handler"),
        redirects=get("redirects", "0"),
        tee=get("tee", "0"),
        local_ranks_filter=get("local_ranks_filter"),
        log_line_prefix_template=_prefix_template(args),
        duplicate_stdout_filters=tuple(get("duplicate_stdout_filters", ())),
        duplicate_stderr_filters=tuple(get("duplicate_stderr_filters", ())),
        local_addr=get("local_addr"),
        logs_specs=get("logs_specs"),
        numa_binding=get("numa_binding"),
        signals_to_handle=get("signals_to_handle"),
        shutdown_timeout=get("shutdown_timeout"),
        virtual_local_rank=get("virtual_local_rank", False),
        rdzv_conf=dict(get("rdzv_extra", {})),
    )
