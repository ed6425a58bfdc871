"""`flywheel`: one entry point per process.

  flywheel bootstrap [--force]   pre-train the demo base model (cached under FLYWHEEL_HOME)
  flywheel serve                 the gateway on the served checkpoint (bootstraps it first if absent)
  flywheel up                    the main job on embedded defaults (today: bootstrap if absent, then serve)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from core.settings import get_settings


def _bootstrap(args) -> dict:
    from demo.bootstrap import BootstrapConfig, bootstrap

    settings = get_settings()
    overrides = {"seed": settings.seed}
    if args.steps:
        overrides["steps"] = args.steps
    report = bootstrap(settings.served_model_dir, BootstrapConfig(**overrides), force=args.force)
    ev = report["eval"]
    print(json.dumps({"model_dir": str(settings.served_model_dir), "pass_rate": ev["pass_rate"],
                      "satisfaction": ev["satisfaction"], "steps": report["steps"],
                      "total_seconds": round(report["total_seconds"], 1)}, indent=2))
    return report


def _serve(args) -> None:
    from api.main import serve

    settings = get_settings()
    if not (settings.served_model_dir / "config.json").is_file():
        if settings.model_dir is not None:
            sys.exit(f"flywheel: no checkpoint at FLYWHEEL_MODEL_DIR={settings.model_dir}")
        args.force, args.steps = False, None
        _bootstrap(args)
    serve(settings)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="flywheel", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bootstrap", help="pre-train the demo base model")
    b.add_argument("--force", action="store_true", help="retrain even if a cached model exists")
    b.add_argument("--steps", type=int, default=None, help="override the number of optimizer steps")
    sub.add_parser("serve", help="run the gateway")
    sub.add_parser("up", help="the main job on embedded defaults")
    args = p.parse_args(argv)
    if args.cmd == "bootstrap":
        _bootstrap(args)
    elif args.cmd in ("serve", "up"):
        _serve(args)


if __name__ == "__main__":
    main()
