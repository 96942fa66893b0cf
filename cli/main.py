"""The command line: parses flags and environment into typed configs and hands off to a role.

Roles: ``ps`` (a parameter server), ``worker`` (one training worker), ``store`` (the group's
coordinator: its store and janitor, for jobs whose servers have standbys), ``local`` (servers plus
N workers on this machine, supervised), ``ctl`` (a client of a running server's control plane),
``evaluate`` (the sidecar evaluator), ``export`` (a checkpoint to the model's own state_dict file),
``reshard`` (a stopped job's checkpoint directory rewritten for another ``--shards``).
Every option is generated from the settings the config classes declare (``rpcps.settings``).
Nothing but ``trainer_entry.py`` calls ``main``.
"""

from __future__ import annotations

import argparse
import difflib
import faulthandler
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from rpcps import memory
from rpcps.options import add_settings, resolve
from rpcps.settings import Declared, build, declared


@dataclass(frozen=True)
class Role:
    """One subcommand: its config class and the function that runs it, as 'module:name'.

    They are imported only for the role that runs, so a worker process never loads the server's
    modules (and the server never loads the worker's).
    """

    help: str
    config: str
    run: str
    exclude: tuple[str, ...] = ()
    """Flags (or one field's dotted path) of the config that this role does not take: it sets them itself, or they
    mean nothing to it."""

    def settings(self) -> list[Declared]:
        return declared(_load(self.config), self.exclude)


ONE_SHOT_EXCLUDES = ("--malloc-trim-s",)
"""What a role that does its one job and exits does not take: a periodic trim would never run."""

ROLES: dict[str, Role] = {
    "ps": Role("run a parameter server (one per shard)", "ps.config:ServerRunConfig", "ps.runner:run_server"),
    "worker": Role("run one training worker against a server", "worker.config:WorkerRunConfig", "worker.runner:run_worker"),
    "store": Role(
        "run the group's coordinator: its rendezvous store and membership upkeep (servers with --replicas 2 need one)",
        "cli.config:StoreConfig",
        "cli.store:run_store",
    ),
    "local": Role(
        "run a server and N workers on this machine, supervised, with progress",
        "cli.config:LocalConfig",
        "cli.local:run_local",
        # local picks these for each child itself: loopback addresses, free ports, slots.
        exclude=(
            "--listen", "server.store", "--metrics-port", "--control-addr", "--control-port", "--shard-index", "--worker-index",
            "--num-workers", "--supervise", "--trust-network",
        ),
    ),
    "ctl": Role(
        "talk to a running server's control plane: status, checkpoint, pause, resume, shutdown",
        "cli.ctl_config:CtlConfig",
        "cli.ctl:run",
    ),
    "evaluate": Role(
        "the sidecar evaluator: score the newest model on held-out data every few seconds, export the scores as metrics",
        "evaluator.config:EvaluatorRunConfig",
        "evaluator.runner:run_evaluator",
    ),
    "export": Role(
        "write the model a checkpoint holds as a plain PyTorch state_dict (or safetensors) file",
        "cli.config:ExportConfig",
        "cli.export:run_export",
        exclude=ONE_SHOT_EXCLUDES,
    ),
    "reshard": Role(
        "rewrite a stopped job's checkpoint directory for another --shards (parameters, optimizer state, progress, sparse rows)",
        "cli.config:ReshardConfig",
        "cli.reshard:run_reshard",
        exclude=ONE_SHOT_EXCLUDES,
    ),
}


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class _Parser(argparse.ArgumentParser):
    """Bad flags get one line on stderr that says where help is, not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser(role: str | None) -> tuple[argparse.ArgumentParser, dict[str, _Parser]]:
    """The parser; only ``role``'s subcommand gets its options (the others only their help line)."""
    # allow_abbrev=False: a prefix such as --worker would otherwise be taken silently as --workers.
    parser = _Parser(
        prog="rpcps",
        allow_abbrev=False,
        description="rpcps: a fault-tolerant parameter server for PyTorch on torch.distributed.rpc. "
        "Precedence of settings: flag > RPCPS_* environment variable > torchrun's variables > default.",
    )
    sub = parser.add_subparsers(dest="role", required=True, metavar="ROLE", parser_class=_Parser)
    parsers = {}
    for name, spec in ROLES.items():
        p = sub.add_parser(name, help=spec.help, description=spec.help, allow_abbrev=False)
        if name == role:
            if name == "ctl":
                p.add_argument("action", choices=_load("cli.ctl:ACTIONS"), help="what to ask the server")
                p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
            add_settings(p, spec.settings())
        parsers[name] = p
    return parser, parsers


def parse(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Any]:
    """The role's arguments and its validated config; exits 2 with one line for a bad flag or value."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, parsers = build_parser(argv[0] if argv and argv[0] in ROLES else None)
    args, unknown = parser.parse_known_args(argv)
    spec, sub = ROLES[args.role], parsers[args.role]
    if unknown:  # said by the role's parser, so the line points to the role's own --help
        sub.error(_unrecognized(unknown, sub))
    settings = spec.settings()
    try:
        return args, build(_load(spec.config), resolve(args, settings, sub))
    except ValueError as e:  # a config's own validation: it names the setting and what it allows
        sub.exit(2, f"{sub.prog}: error: {_flag_for_field(str(e), settings)}\n")


def _flag_for_field(message: str, settings: Sequence[Declared]) -> str:
    """A config's validation names its field ("async_beta2 must be ..."); the person typed a flag, so
    a message that starts with the field of a flag of the same name (--async-beta2) starts with the
    flag instead. Fields behind a flag of another name (``optimizer`` is --sparse-optimizer; "optimizer
    'sgd' ..." is about --optimizer) are left as they are."""
    field, _, rest = message.partition(" ")
    flag = "--" + field.replace("_", "-")
    return f"{flag} {rest}" if rest and any(d.path[-1] == field and d.flag == flag for d in settings) else message


def _unrecognized(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """"unrecognized arguments: ...", with the nearest real flag for the first unknown one."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    flags = [s for action in parser._actions for s in action.option_strings]  # argparse keeps no public list of them
    first = next((u.split("=", 1)[0] for u in unknown if u.startswith("--")), None)
    close = difflib.get_close_matches(first, flags, n=1) if first else []
    return message + (f"; did you mean {close[0]}?" if close else "")


CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
CPP_LOG_LEVEL = "ERROR"


def main(argv: Sequence[str] | None = None) -> int:
    # Before anything imports torch (its C++ logging reads this once): torch RPC's C++ layer warns of
    # every pipe a peer closes, at every normal shutdown too. rpcps reports lost peers itself, in one
    # line each; whoever wants torch's own lines back sets TORCH_CPP_LOG_LEVEL=WARNING (or INFO).
    os.environ.setdefault(CPP_LOG_LEVEL_ENV, CPP_LOG_LEVEL)
    memory.prefer_huge_pages(os.environ)  # before torch's first allocation, which reads it (rpcps.memory)
    args, config = parse(argv)
    run = _load(ROLES[args.role].run)
    if args.role == "ctl":
        return run(args.action, config, as_json=args.json)
    # By name, like the roles: a module-level import would load torch into ctl, a gRPC client that
    # has no use for its 2-3 s of start-up.
    transport_errors = (_load("rpcps.transport:TransportError"), _load("rpcps.transport:FilterUnavailable"))
    _configure_logging(args.role, config)
    _stacks_on_sigusr1()
    try:
        return run(config)
    except ValueError as e:  # bad settings caught late (a plug-in spec, a refused resume)
        print(f"rpcps {args.role}: error: {e}", file=sys.stderr)
        return 2
    except (*transport_errors, OSError) as e:
        print(f"rpcps {args.role}: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError:
        logging.getLogger("rpcps").exception("failed")
        return 1


def _stacks_on_sigusr1() -> None:
    """From now on `kill -USR1 PID` prints every thread's Python stack to stderr (the log) and the
    process runs on: what a stuck process waits for, on a host without py-spy or gdb
    (docs/FAULT_TOLERANCE.md). Not where stderr is no file (a caller that captured it)."""
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (OSError, ValueError):  # io.UnsupportedOperation: a stderr without a file descriptor
        pass


def _configure_logging(role: str, config: Any) -> None:
    tag = {"worker": lambda: f"worker{config.worker.worker_index}", "ps": lambda: f"ps{config.core.shard_index}"}.get(
        role, lambda: role
    )()
    logging.basicConfig(
        level=config.process.log_level,
        format=f"%(asctime)s %(levelname)s [{tag} pid %(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
