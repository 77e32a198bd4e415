"""The `gpufrac` command line.

Each subcommand's work lives in the module that owns the capability; this file
only parses arguments and dispatches, importing lazily so `gpufrac gpus` does not
pay for gRPC or the kubernetes client.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable, Sequence

import gpufrac
from gpufrac.core.output import add_output_args

# subcommand -> (module, function, help); the function takes the parsed args and
# returns an exit code.
Handler = tuple[str, str, str]

EXIT_CODES = """\
exit codes (every command):
  0    done
  1    what was asked for could not be read or done: no NVIDIA driver, the agent not
       reachable, no such container, a simulated-node demo step failed
  2    bad usage or a bad node config (the message names the argument or the key)
  130  stopped by SIGINT (Ctrl-C)
  143  stopped by SIGTERM
"""


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="node config YAML (default: built-in defaults)")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Handler]]:
    parser = argparse.ArgumentParser(
        prog="gpufrac",
        description="GPU sharing for Kubernetes nodes.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpufrac {gpufrac.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    handlers: dict[str, Handler] = {}

    def add(name: str, module: str, func: str, help_: str) -> argparse.ArgumentParser:
        handlers[name] = (module, func, help_)
        p = sub.add_parser(
            name,
            help=help_,
            description=help_,
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_common(p)
        return p

    p = add("run", "gpufrac.demo", "cmd_run", "run the agent (real node) or the simulated-node demo")
    p.add_argument("--sim", action="store_true", help="force the simulated node even if a GPU is present")
    p.add_argument("--preset", default="dgx-h100", help="simgpu preset for the demo")
    p.add_argument("--keep", action="store_true", help="keep serving after the demo until Ctrl-C")

    p = add("agent", "gpufrac.agent.main", "cmd_agent", "run the node agent (the DaemonSet's process)")
    p.add_argument(
        "--config-overlay",
        action="append",
        default=[],
        metavar="PATH",
        help="a node config YAML merged over --config (repeatable; the DRA DaemonSet's mode: dra)",
    )

    p = add("gpus", "gpufrac.agent.cli.gpus", "cmd_gpus", "list the node's GPUs with memory and health")
    add_output_args(p)

    p = add("topo", "gpufrac.agent.cli.gpus", "cmd_topo", "GPU interconnect matrix, NUMA and CPU affinity")
    add_output_args(p)

    p = add(
        "status", "gpufrac.agent.cli.status", "cmd_status", "the node at a glance, from the running agent"
    )
    add_output_args(p)
    p.add_argument("--socket", help="the agent's status socket (default: statusSocket of --config)")

    p = add("memguard", "gpufrac.agent.cli.memguard", "cmd_memguard", "inspect a container's memguard files")
    p.add_argument("action", choices=["inspect"])
    p.add_argument(
        "container_dir",
        metavar="TARGET",
        help="NAMESPACE/POD[/CONTAINER] (found through the running agent), or the container's "
        "gpufrac directory as a host path (starting with / or .)",
    )
    add_output_args(p)
    p.add_argument(
        "--socket", help="the agent's status socket, for NAMESPACE/POD (default: statusSocket of --config)"
    )

    p = add("sim", "gpufrac.simgpu.cli", "cmd_sim", "manage a simulated GPU node (tests, demo)")
    p.add_argument("sim_args", nargs=argparse.REMAINDER, help="simgpu subcommand and its arguments")
    return parser, handlers


def main(argv: Sequence[str] | None = None) -> int:
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    module, func, _ = handlers[args.command]
    # Each subcommand's module is imported only when that subcommand runs: `gpufrac gpus` must
    # not pay for (or fail on) the agent's grpc/kubernetes/prometheus imports, nor `gpufrac
    # status` for NVML. The table above names every module and function, so this is a lookup,
    # not a discovery.
    fn: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), func)
    try:
        return int(fn(args) or 0)
    except KeyboardInterrupt as e:
        # SIGINT, or SIGTERM/SIGHUP where a command turns them into one (gpufrac.demo).
        return 128 + int(getattr(e, "signum", signal.SIGINT))
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
