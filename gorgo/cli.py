"""The single entry point: `gorgo <command> [<subcommand>] ...`.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int``;
only the chosen one is imported, so `gorgo replay` never pays for gRPC or Envoy imports.

One way to fail, one way to stop, so scripts and supervisors can rely on them:

- exit 2: a problem the user can fix (a `gorgo.errors.UserError`, bad arguments, an unknown
  command). stderr gets exactly one line, ``gorgo <command>: <what is wrong, what to do>``.
- SIGTERM or Ctrl-C (SIGINT): the command winds down in order and stderr gets one line,
  ``gorgo <command>: stopped (SIGTERM)``. A server (`extproc`, `tuner`, `sim engine`,
  `sim fleet`) exits 0, since being stopped is how it ends; a batch command (`demo`, `replay`,
  `bench ...`) exits 130, since its work was cut short.
- exit 141: stdout was closed early (`gorgo ... | head`), quietly.
- any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading

from gorgo import shutdown
from gorgo.errors import OneLineParser, UserError

# command words -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("extproc",): ("extproc.main", "run the Envoy ext_proc routing server"),
    ("envoy-config",): ("gorgo.envoy_config", "render an Envoy bootstrap for a fleet file"),
    ("envoy-drain",): ("gorgo.envoy_drain", "drain a local Envoy before it stops (preStop)"),
    ("explain",): ("gorgo.explain", "show each replica's cost terms for one request"),
    ("sim", "engine"): ("gorgo.sim.engine_server", "run one simulated OpenAI-compatible engine"),
    ("sim", "fleet"): ("gorgo.sim.fleet", "run a simulated fleet (engines behind emulated links)"),
    ("sim", "view"): ("gorgo.sim.view", "write another proxy region's view of a simulated fleet"),
    ("replay",): ("gorgo.sim.replay", "replay a trace open-loop against a URL"),
    ("bench", "sim"): ("gorgo.sim.bench", "rank policies in the offline simulation"),
    ("bench", "tune"): ("gorgo.sim.tunebench.cli", "offline convergence run of the tuner"),
    ("tuner",): ("tuner.main", "run the online weight tuner (OTLP receiver)"),
    ("demo",): ("gorgo.demo", "run the simulated 3-region demo end to end"),
}
# Commands that run until told to stop: a stop signal is their normal end (exit 0).
SERVERS = {("extproc",), ("tuner",), ("sim", "engine"), ("sim", "fleet")}
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a command killed by it


def _usage(group: tuple[str, ...] = ()) -> str:
    head = " ".join(("gorgo", *group))
    lines = [f"usage: {head} <command> [options]", "", "commands:"]
    for words, (_, text) in COMMANDS.items():
        if words[:len(group)] == group:
            lines.append(f"  {' '.join(words):<16} {text}")
    lines += ["", "`gorgo <command> --help` explains a command's options; "
              "`gorgo --version` prints the version."]
    return "\n".join(lines)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gorgo-router")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        from gorgo import __version__

        return __version__


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _lookup(argv: list[str]) -> tuple[str, ...] | int:
    """The command words at the front of ``argv``, or the exit status once usage is printed."""
    for n in (2, 1):
        if tuple(argv[:n]) in COMMANDS:
            return tuple(argv[:n])
    group = tuple(argv[:1]) if any(w[:1] == tuple(argv[:1]) for w in COMMANDS) else ()
    rest = argv[len(group):]
    if not rest or rest[0] in ("-h", "--help"):  # `gorgo`, `gorgo --help`, `gorgo sim`
        print(_usage(group))
        return 0
    print(f"{' '.join(('gorgo', *group))}: unknown command {rest[0]!r}", file=sys.stderr)
    print(_usage(group), file=sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        print(f"gorgo {_version()}")
        return 0
    words = _lookup(argv)
    if isinstance(words, int):
        return words
    module_name, text = COMMANDS[words]
    prog = f"gorgo {' '.join(words)}"
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in shutdown.STOP_SIGNALS}
    shutdown.received = None
    if main_thread:  # signal handlers can only be set there
        shutdown.install()
    try:
        module = importlib.import_module(module_name)
        parser = OneLineParser(prog=prog, description=text)
        module.add_arguments(parser)
        rc = int(module.main(parser.parse_args(argv[len(words):])) or 0)
    except UserError as exc:
        if shutdown.received is None:  # else a start cut short by a stop signal: a stop
            print(f"{prog}: {_one_line(exc)}", file=sys.stderr)
            return EXIT_USAGE
        rc = EXIT_INTERRUPTED
    except KeyboardInterrupt:
        shutdown.note(signal.SIGINT)  # keeps a SIGTERM noted by the handler
        rc = EXIT_INTERRUPTED
    except BrokenPipeError:  # `gorgo ... | head`: the reader left, which is no bug
        with contextlib.suppress(OSError, ValueError):  # no flush error at exit either
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    finally:
        if main_thread:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if shutdown.received is not None:
        print(f"{prog}: stopped ({shutdown.received.name})", file=sys.stderr)
        return 0 if words in SERVERS else EXIT_INTERRUPTED
    return rc


if __name__ == "__main__":
    sys.exit(main())
