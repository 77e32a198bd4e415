"""`gpufrac memguard inspect NAMESPACE/POD[/CONTAINER]` (or a container's directory): the command.

gpufrac.memguard.inspector reads a container's files and formats them; this finds the
container's directory through the running agent's status socket when given a pod name.
"""

from __future__ import annotations

import argparse
import sys

from gpufrac.agent.cli.status import default_socket
from gpufrac.agent.status.client import StatusUnavailable, fetch
from gpufrac.core.config import ConfigError
from gpufrac.core.output import render
from gpufrac.memguard import abi
from gpufrac.memguard.inspector import (
    TargetError,
    format_report,
    inspect_dir,
    is_host_path,
    parse_target,
    resolve_target,
)


def _fail(message: str, code: int) -> int:
    print(f"gpufrac memguard inspect: {message}", file=sys.stderr)
    return code


def cmd_memguard(args: argparse.Namespace) -> int:
    target = str(args.container_dir)
    directory = target
    if not is_host_path(target):
        try:
            namespace, pod, container = parse_target(target)
        except ValueError as e:
            return _fail(str(e), 2)
        try:
            path = default_socket(args)
        except ConfigError as e:
            return _fail(str(e), 2)
        try:
            directory = resolve_target(fetch(path), namespace, pod, container)
        except (StatusUnavailable, TargetError) as e:
            return _fail(str(e), 1)
    try:
        d = inspect_dir(directory)
    except abi.FormatError as e:
        return _fail(str(e), 1)
    print(render(args, d, lambda wide: format_report(d, wide=wide)))
    return 0
