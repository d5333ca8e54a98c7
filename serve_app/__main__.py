"""`python -m serve_app <command>`: small operator commands. Add a command with one `_cmd_*` function and one
subparser in `build_parser`.

    codex-config --base-url URL   print a Codex config.toml provider block and write the model catalog it names
                                  (asks the running service for its models and whether it wants a key)
    families [--json]             the model-family catalog: templates (source, revision, license), parsers, thinking
    run CONFIG [--dashboard]      serve a Serve config file on this host, on a local Ray started without the
                                  dashboard and idle daemons it does not need (serve_app/launch.py)
    run CONFIG --single-process   the same config's service in this one process, without Ray
                                  (serve_app/single_process.py)
    status [--json]               the running service's applications, deployments and replicas, from Serve's
                                  controller (what `serve status` shows, without needing the dashboard)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_CONFIG = "config.yaml"
ENV_KEY = "SERVE_APP_API_KEY"


def _load_settings(path: str):
    from serve_app.settings import AppSettings

    p = Path(path)
    if not p.exists() and not p.is_absolute():
        p = Path(__file__).resolve().parent.parent / path  # the project's embedded default config
    return AppSettings.from_yaml(p)


def _cmd_codex_config(args: argparse.Namespace) -> int:
    from serve_app import tenants
    from serve_app.codex import ask_service, codex_models_payload, write_codex_config

    # The running service decides (its models, whether it wants a key): it may run another config than the one
    # beside this command. The config is the fallback when the service cannot be asked.
    answer = None if args.offline else ask_service(args.base_url, os.environ.get(ENV_KEY))
    entries, source = (answer.entries, f"the service at {args.base_url}") if answer and answer.entries else (None, "")
    settings = None
    if entries is None:  # also whenever the service could not say whether it wants a key
        settings = _load_settings(args.config)
        entries, source = codex_models_payload(settings.models), args.config
        if answer is not None and not answer.reachable:
            print(f"# could not ask the service ({answer.detail}); using {args.config}", file=sys.stderr)
        elif answer is not None and answer.key_required:
            print(f"# the service wants a key to list its models: set ${ENV_KEY} to read them from it; "
                  f"using {args.config}", file=sys.stderr)
    slugs = [e["slug"] for e in entries]
    if args.model and args.model not in slugs:
        print(f"error: model {args.model!r} is not served by {source}", file=sys.stderr)
        return 2
    if args.no_env_key:
        env_key, why = None, "--no-env-key"
    elif args.env_key:
        env_key, why = args.env_key, "--env-key"
    elif answer is not None and answer.key_required is not None:
        env_key = ENV_KEY if answer.key_required else None
        why = f"the service at {args.base_url} {'requires' if answer.key_required else 'does not require'} a key"
    else:
        required = tenants.key_required(settings.ingress.api_keys)
        env_key = ENV_KEY if required else None
        why = f"{args.config} {'requires' if required else 'does not require'} a key (ingress.api_keys)"
    block = write_codex_config(entries, args.base_url, args.catalog_out, model=args.model, env_key=env_key)
    print(block, end="")
    if env_key is None:
        # Codex stops with "Missing environment variable" when a provider names an env_key that is unset, so a
        # service without keys gets a provider without one.
        print(f"# no env_key: {why} (pass --env-key NAME to name one)", file=sys.stderr)
    else:
        print(f"# Codex reads the API key from ${env_key} ({why})", file=sys.stderr)
    print(f"# models from {source}; catalog written to {Path(args.catalog_out).expanduser().resolve()}",
          file=sys.stderr)
    return 0


def _cmd_families(args: argparse.Namespace) -> int:
    import json

    from serve_app.families import load_catalog

    catalog = load_catalog()
    if args.json:
        print(json.dumps({name: fam.summary() for name, fam in catalog.items()}, indent=2, ensure_ascii=False))
        return 0
    print(f"{'family':14} {'reasoning':12} {'tools':13} {'in prompt':9} {'replay':9}  template (source @ revision, license)")
    for fam in catalog.values():
        src = fam.source
        print(f"{fam.name:14} {fam.reasoning_parser or '-':12} {fam.tool_parser or '-':13} "
              f"{'yes' if fam.thinking_in_prompt else 'no':9} {fam.thinking_replay:9}  {fam.template} "
              f"({src.repo}:{src.path} @ {src.commit[:12]}, {src.license})")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    if args.single_process:
        import logging

        from serve_app import single_process

        if args.dashboard or args.address:
            print("error: --single-process runs no Ray: --dashboard and --address do not apply", file=sys.stderr)
            return 2
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
        try:
            settings = _load_settings(args.config)
        except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
            print(f"error: {args.config}: {e}", file=sys.stderr)
            return 2
        return single_process.run(settings)

    from serve_app.launch import run

    return run(args.config, dashboard=args.dashboard, address=args.address or os.environ.get("RAY_ADDRESS") or None)


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    import yaml

    from serve_app.launch import status

    try:
        summary = status(args.address)
    except ConnectionError as e:  # no Ray cluster at that address (nothing running)
        print(f"error: no running service found ({e})", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2) if args.json else yaml.safe_dump(summary, sort_keys=False), end="")
    apps = summary["applications"].values()
    return 0 if apps and all(a["status"] == "RUNNING" for a in apps) else 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m serve_app", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    codex = sub.add_parser("codex-config", help="Codex CLI provider block + model catalog for this deployment")
    codex.add_argument("--base-url", required=True, help="the service's URL, e.g. http://host:8000 (/v1 is added)")
    codex.add_argument("--config", default=DEFAULT_CONFIG,
                       help="Serve config (or bare args) YAML with the models, used when the service cannot be asked")
    codex.add_argument("--catalog-out", default="~/.codex/serve_app_models.json",
                       help="where to write the model catalog JSON (config.toml's model_catalog_json)")
    codex.add_argument("--model", default=None, help="the model Codex uses by default (first served id if unset)")
    codex.add_argument("--env-key", default=None,
                       help=f"env var holding the API key (default: {ENV_KEY} when the service answers GET /v1/models "
                            "without a key with 401, none when it answers 200)")
    codex.add_argument("--no-env-key", action="store_true", help="never name an env var, even with API keys")
    codex.add_argument("--offline", action="store_true",
                       help="do not ask the service; take the models and the key rule from --config")
    codex.set_defaults(func=_cmd_codex_config)

    families = sub.add_parser("families", help="the model-family catalog (templates, parsers, thinking policy)")
    families.add_argument("--json", action="store_true", help="the whole catalog as JSON")
    families.set_defaults(func=_cmd_families)

    run = sub.add_parser("run", help="serve a Serve config file on this host (`serve run` on a lean local Ray)")
    run.add_argument("config", help="the Serve config file, e.g. config.yaml")
    run.add_argument("--dashboard", action="store_true",
                     help="start Ray's dashboard too (needed by `serve status` and `serve config`)")
    run.add_argument("--address", default=None,
                     help="join this running Ray cluster instead of starting one, as `serve run --address` does "
                          "(default: $RAY_ADDRESS)")
    run.add_argument("--single-process", action="store_true",
                     help="serve the config in this one process, without Ray: the engines in the process, the "
                          "port from ingress.listen (config.yaml's topology; serve_app/single_process.py)")
    run.set_defaults(func=_cmd_run)

    status = sub.add_parser("status", help="the running service's applications, deployments and replicas "
                                           "(exit status 0 only when every application is RUNNING)")
    status.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or None,
                        help="the Ray cluster to ask (default: $RAY_ADDRESS, else the one on this host)")
    status.add_argument("--json", action="store_true", help="JSON instead of YAML")
    status.set_defaults(func=_cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
