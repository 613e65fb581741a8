"""The single entry point: `gorgo <command> [<subcommand>] ...`.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int``;
only the chosen one is imported, so `gorgo replay` never pays for gRPC or Envoy imports.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# command words -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("extproc",): ("extproc.main", "run the Envoy ext_proc routing server"),
    ("envoy-config",): ("gorgo.envoy_config", "render an Envoy bootstrap for a fleet file"),
    ("explain",): ("gorgo.explain", "show each replica's cost terms for one request"),
    ("sim", "engine"): ("gorgo.sim.engine_server", "run one simulated OpenAI-compatible engine"),
    ("sim", "fleet"): ("gorgo.sim.fleet", "run a simulated fleet (engines behind emulated links)"),
    ("replay",): ("gorgo.sim.replay", "replay a trace open-loop against a URL"),
    ("bench", "sim"): ("gorgo.sim.bench", "rank policies in the offline simulation"),
    ("bench", "tune"): ("gorgo.sim.tune_bench", "offline convergence run of the tuner"),
    ("tuner",): ("tuner.main", "run the online weight tuner (OTLP receiver)"),
    ("demo",): ("gorgo.demo", "run the simulated 3-region demo end to end"),
}


def _usage() -> str:
    lines = ["usage: gorgo <command> [options]", "", "commands:"]
    for words, (_, text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<16} {text}")
    lines.append("")
    lines.append("`gorgo <command> --help` explains a command's options.")
    return "\n".join(lines)


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for n in (2, 1):
        words = tuple(argv[:n])
        if words in COMMANDS:
            break
    else:
        print(_usage(), file=sys.stdout if not argv or argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module_name, text = COMMANDS[words]
    if not _available(module_name):
        print(f"gorgo {' '.join(words)}: not built yet in this version.", file=sys.stderr)
        return 2
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"gorgo {' '.join(words)}", description=text)
    module.add_arguments(parser)
    args = parser.parse_args(argv[len(words):])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
