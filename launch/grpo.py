#!/usr/bin/env python
"""Launch a cotrain GRPO run.

    python launch/grpo.py --config configs/demo.yaml [key.path=value ...] [--validate-only] [--resume]

Loads the YAML config (with its `defaults:` chain), applies the dotted overrides and validates
everything (schema and cross-field checks) before anything starts.

  --validate-only   print a summary of the validated config and exit 0; on an invalid config print
                    the errors and exit 2 (in every mode).
  --print-config    also print the full resolved config as YAML.
  --resume [PATH]   continue from the newest checkpoint in checkpoint.dir (or from PATH); the same
                    as the override checkpoint.resume=true (or =PATH).
  --overwrite       a fresh run into a folder that holds another run deletes that run's files
                    first (run.overwrite=true); without it (or --resume) such a run is refused.

Otherwise it runs the GRPO loop: `cotrain.rl.driver.main(cfg, resume=...)`. Works from the repo root
and under `ray job submit --working-dir . -- python launch/grpo.py ...`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="launch/grpo.py",
        description="Run GRPO with online drafter co-training (cotrain).",
        epilog="Overrides: dotted key paths with YAML values, e.g. policy.parallel.pipeline=2 "
               "rollout.sampling.temperature=0.7 draft.kind=null. See docs/config.md.",
    )
    ap.add_argument("--config", required=True, help="YAML config file, e.g. configs/demo.yaml")
    ap.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides")
    ap.add_argument("--validate-only", action="store_true", help="validate, print a summary, exit")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config as YAML")
    ap.add_argument("--resume", nargs="?", const=True, default=None, metavar="PATH",
                    help="resume from the newest checkpoint (or from PATH)")
    ap.add_argument("--overwrite", action="store_true",
                    help="delete the files of the run already in run.output_dir before a fresh start")
    return ap.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cotrain.config import ConfigError, load_config
    from cotrain.config.summary import print_summary

    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={'true' if args.resume is True else args.resume}")
    if args.overwrite:
        overrides.append("run.overwrite=true")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"config error ({args.config}):\n{e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_config:
        print(cfg.to_yaml(), end="")
    if args.validate_only:
        print_summary(cfg, title=f"config OK: {args.config}")
        return EXIT_OK

    from cotrain.rl import driver
    from cotrain.checkpoint import CheckpointError
    from cotrain.runfolder import RunFolderError

    try:
        driver.main(cfg, resume=cfg.checkpoint.resume)
    except NotImplementedError as e:  # a valid config asking for what the loop does not do yet
        print(f"not supported yet ({args.config}):\n{e}", file=sys.stderr)
        return EXIT_CONFIG
    except ConfigError as e:  # what only the run can see (e.g. the data changed since validation)
        print(f"config error ({args.config}):\n{e}", file=sys.stderr)
        return EXIT_CONFIG
    except CheckpointError as e:
        print(f"checkpoint error ({args.config}):\n{e}", file=sys.stderr)  # names the damaged file
        return EXIT_CONFIG
    except RunFolderError as e:  # the folder changed since validation, or a checkpoint of another run
        print(f"run folder error ({args.config}):\n{e}", file=sys.stderr)
        return EXIT_CONFIG
    except driver.NonFiniteError as e:
        print(f"training stopped ({args.config}):\n{e}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
