"""The `sao` command line. Every subcommand calls one `sao_core` function (the same one the KFP
components and the tests call); this module only parses arguments, sets up logging and progress bars,
and turns library errors into one clear line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sao_core.config import (
    ConfigError,
    _base_type,
    field_types,
    flatten_sections,
    is_registered,
    literal_choices,
    load_config,
    settings_of,
)

log = logging.getLogger("sao")


def default_cache_dir() -> str:
    """Where built and downloaded models live: $SAO_CACHE_DIR, else ~/.cache/sao."""
    return os.environ.get("SAO_CACHE_DIR") or str(Path.home() / ".cache" / "sao")


# ----------------------------------------------------------------------------- dataclass <-> argparse
def add_config_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                         title: str = "") -> None:
    """One `--field-name` option per dataclass field, in argument groups: a setting (`sao_core.config.setting`)
    in its section's, every field of a plain dataclass (help from its trailing comment) in `title`'s. Values
    left unset fall back to the --config YAML, then to the defaults."""
    registered = is_registered(cls)
    if not registered and not title:
        raise ValueError(f"{cls.__name__} has no settings with sections: give the title of its --help group")
    parser.add_argument("--config", metavar="YAML", help=(
        "YAML file with field: value pairs, flat or grouped by section (section: {field: value}); flags override it"
        if registered else "YAML file with field: value pairs (flags override it)"))
    if registered:   # (help, unit, group title, the group's description: its section key for YAML)
        helps = {s.name: (s.help, s.unit, s.title, f"YAML section: {s.section}") for s in settings_of(cls).values()}
    else:
        docs = _field_docs(cls)
        helps = {f.name: (docs.get(f.name, ""), "", title, None) for f in dataclasses.fields(cls)}
    types_by_name = field_types(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        help_text, unit, group_title, description = helps[field.name]
        if group_title not in groups:
            groups[group_title] = parser.add_argument_group(group_title, description)
        shown = _shown_default(field)
        shown = shown if shown == "(required)" else f"[default: {shown}]"
        help_text = f"{help_text}{f' ({unit})' if unit else ''} {shown}".strip().replace("%", "%%")
        _add_field_argument(groups[group_title], field.name, types_by_name[field.name], help_text)
    parser._sao_settings = {f.name for f in dataclasses.fields(cls) if f.name not in skip}  # see _compact_usage


def _shown_default(field: dataclasses.Field) -> str:
    """A field's default as --help shows it: `show_default` of it, "(required)", or "(computed)" for a default
    read from the environment (cache_dir, or a factory that fails here)."""
    if field.default is not dataclasses.MISSING:
        return show_default(field.default)
    if field.default_factory is dataclasses.MISSING:
        return "(required)"
    try:
        return "(computed)" if field.name == "cache_dir" else show_default(field.default_factory())
    except Exception:  # a factory that reads the environment and fails here: shown as computed
        return "(computed)"


def _add_field_argument(group: argparse._ArgumentGroup, name: str, annotation: Any, help_text: str) -> None:
    """`--name` (dashes for underscores) into `group`: --x / --no-x for a bool, else one value (its choices as
    the metavar); unset flags stay out of the namespace."""
    flag = "--" + name.replace("_", "-")
    if _base_type(annotation)[0] is bool:
        group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=help_text)
        return
    choices = literal_choices(annotation)
    group.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=help_text,
                       metavar="{" + ",".join(map(str, choices)) + "}" if choices else name.upper())


def show_default(value: Any) -> str:
    """A default as a user would type it: lists and tuples as `a,b` (empty: none), mappings as JSON (empty:
    none), None as none, '' as ''."""
    if value is None:
        return "none"
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) if value else "none"
    if isinstance(value, dict):
        return json.dumps(value) if value else "none"
    if isinstance(value, str):
        return value if value else "''"
    return str(value)


def _usage_word(action: argparse.Action) -> str:
    if not action.option_strings:
        return "..." if action.nargs == argparse.REMAINDER else action.metavar or action.dest
    flag = action.option_strings[0]
    if action.nargs == 0:
        word = flag
    else:
        metavar = action.metavar or ("{" + ",".join(map(str, action.choices)) + "}" if action.choices
                                     else action.dest.upper())
        word = f"{flag} {metavar}"
    return word if action.required else f"[{word}]"


def _compact_usage(parser: argparse.ArgumentParser) -> None:
    """Usage lines of the config-driven commands: their other arguments, then `[--SETTING VALUE ...]` instead of
    every setting (--help lists them by section); recurses into subcommands."""
    settings = getattr(parser, "_sao_settings", None)
    if settings:
        words = [_usage_word(a) for a in parser._actions if a.dest not in settings]
        import textwrap

        indent = " " * len(f"usage: {parser.prog} ")
        parser.usage = textwrap.fill(" ".join(words + ["[--SETTING VALUE ...]"]), 100 - len(indent),
                                     subsequent_indent=indent, break_on_hyphens=False)
        parser.usage = parser.prog + " " + parser.usage.replace("%", "%%")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _compact_usage(child)


def _field_docs(cls: type) -> dict[str, str]:
    """Trailing `# comment` of each field in the dataclass source: the --help text of a config whose fields are
    not made with `sao_core.config.setting` (whose help is in the field's metadata)."""
    import inspect

    docs: dict[str, str] = {}
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return docs
    for line in source.splitlines():
        stripped = line.strip()
        if ":" in stripped and "#" in stripped and not stripped.startswith("#"):
            name = stripped.split(":", 1)[0].strip()
            if name.isidentifier():
                docs[name] = stripped.split("#", 1)[1].strip()
    return docs


def config_from_args(cls: type, args: argparse.Namespace, extra: dict[str, Any] | None = None):
    """Build `cls` from --config YAML plus the flags the user gave."""
    names = {f.name for f in dataclasses.fields(cls)}
    overrides = {k: v for k, v in vars(args).items() if k in names}
    overrides.update(extra or {})
    return load_config(cls, getattr(args, "config", None), overrides)


def _given_settings(cls: type, args: argparse.Namespace) -> set[str]:
    """The settings of `cls` the user set: by a flag or in the --config YAML (the rest are at their defaults)."""
    import yaml

    names = {f.name for f in dataclasses.fields(cls)}
    given = {k for k in vars(args) if k in names}
    if getattr(args, "config", None):
        loaded = yaml.safe_load(Path(args.config).read_text(encoding="utf-8"))   # load_config has checked it
        given |= set(flatten_sections(cls, loaded or {}, args.config)) & names
    return given


def _progress_bar(total: int | None, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step" if total else "row", disable=quiet, file=sys.stderr, mininterval=1.0,
                dynamic_ncols=True)


# ----------------------------------------------------------------------------- subcommands
def cmd_build_model(args: argparse.Namespace) -> int:
    from sao_core.models import EMBEDDED_TINY, resolve_model

    resolved = resolve_model(EMBEDDED_TINY, args.cache_dir)
    if args.publish:
        from sao_core import storage

        storage.publish_checkpoint(resolved.path, args.publish, metadata={"kind": "embedded", "model": EMBEDDED_TINY})
        print(args.publish)
    else:
        print(resolved.path)
    return 0


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from sao_core.data.prepare import PrepareConfig, prepare

    config = config_from_args(PrepareConfig, args)
    with _progress_bar(None, f"prepare {config.kind}", args.quiet) as bar:
        stats = prepare(config, progress=lambda n: bar.update(n - bar.n))
    print(json.dumps(dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else stats, indent=2,
                     default=str))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from sao_core.training.config import METHOD_CONFIGS
    from sao_core.training.trainer import train

    config = config_from_args(METHOD_CONFIGS[args.method], args, {"cache_dir": args.cache_dir})
    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 reports
    with _progress_bar(config.steps, f"train {args.method}", args.quiet or not main_rank) as bar:
        summary = train(args.method, config, progress=lambda step, m: _advance(bar, step, m))
    if main_rank:
        print(json.dumps(summary, indent=2))
    return 0


def _advance(bar, step: int, metrics: dict) -> None:
    bar.update(step - bar.n)
    bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)


def cmd_train_rl(args: argparse.Namespace) -> int:
    from sao_core.learner.config import RLConfig
    from sao_core.learner.loop import train_rl

    config = config_from_args(RLConfig, args, {"cache_dir": args.cache_dir})
    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 reports
    with _progress_bar(config.steps, f"train-rl {config.method}", args.quiet or not main_rank) as bar:
        def show(step: int, metrics: dict) -> None:
            bar.update(step - bar.n)
            # a batch of fragments only has no episode reward (rollout/admission.py)
            reward = f"{metrics['reward_mean']:.2f}" if "reward_mean" in metrics else "-"
            bar.set_postfix(reward=reward, v=metrics["version"], refresh=False)

        summary = train_rl(config, progress=show)
    if main_rank:
        print(json.dumps(summary, indent=2))
    return 0


def cmd_rollout_serve(args: argparse.Namespace) -> int:
    from sao_core.rollout.manager import RolloutPlan
    from sao_core.rollout.server import ServeConfig, serve

    config = config_from_args(ServeConfig, args, {"cache_dir": args.cache_dir})
    plan = load_config(RolloutPlan, args.plan) if args.plan else None
    if plan is not None:
        plan.validate()
    print(f"rollout service: http://{config.host}:{config.port} (engine {config.engine}, model {config.model}); "
          "OpenAPI at /docs; stop with POST /v1/shutdown or Ctrl-C", file=sys.stderr)
    serve(config, plan)
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from sao_core import storage

    action = args.action
    if action == "publish":
        if not args.source:
            raise ConfigError("checkpoint publish needs --source LOCAL_DIR")
        manifest = storage.publish_checkpoint(args.source, args.uri)
        print(f"published {len(manifest['files'])} files to {args.uri}")
    elif action == "verify":
        local = storage.fetch_checkpoint(args.uri, Path(args.cache_dir) / "s3")
        print(f"ok: {args.uri} verified ({local})")
    elif action == "latest":
        latest = storage.latest_checkpoint(args.uri)
        if latest is None:
            print(f"no complete checkpoint under {args.uri}", file=sys.stderr)
            return 1
        print(latest)
    elif action == "merge":
        from sao_core.training.merge import merge_checkpoint

        result = merge_checkpoint(args.base, args.adapter, args.output, args.cache_dir, dtype=args.dtype,
                                  unverified=args.unverified)
        print(json.dumps(result, indent=2))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from sao_core.eval.config import EvalConfig
    from sao_core.eval.run import evaluate, fit_budget_to_context

    config = config_from_args(EvalConfig, args, {"cache_dir": args.cache_dir})
    config = fit_budget_to_context(config, _given_settings(EvalConfig, args))
    with _progress_bar(None, f"evaluate {','.join(config.benchmark_list)}", args.quiet) as bar:
        def show(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        summary = evaluate(config, progress=show)
    print(json.dumps(summary["metrics"], indent=2, sort_keys=True))
    print(f"\nreport: {summary['files']['report']}\nsummary: {summary['files']['summary']}")
    return 0


def cmd_judge_agreement(args: argparse.Namespace) -> int:
    import os

    from sao_core.eval.judge import LABELLED_SET, LLMJudge, judge_agreement, read_labelled

    pairs = read_labelled(args.labelled or LABELLED_SET)
    key = os.environ.get(args.judge_api_key_env) if args.judge_api_key_env else None
    judge = LLMJudge(args.judge_url, args.judge_model, api_key=key, api=args.judge_api, timeout_s=args.timeout_s,
                     max_tokens=args.max_tokens, concurrency=args.concurrency)
    try:
        report = judge_agreement(judge, pairs)
    finally:
        judge.close()
    report["labelled"] = str(args.labelled or LABELLED_SET)
    text = json.dumps(report, indent=2)
    if args.output:
        from sao_core import storage

        storage.write_text(args.output, text + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "disagreements"}, indent=2))
    print(f"{len(report['disagreements'])} disagreements" + (f" (all in {args.output})" if args.output else ""))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from sao_core.reporting.training import write_training_report

    written = write_training_report(args.run_dir, target=args.output)
    print(written)
    return 0


# ----------------------------------------------------------------------------- sao cluster (multi-node TrainJob)
def cmd_cluster(args: argparse.Namespace) -> int:
    import yaml

    from sao_core import images
    from sao_core.cluster import entry, golden, launcher, manifests
    from sao_core.cluster.api import ClusterError, KubeAPI

    action = args.cluster_command
    try:
        if action == "render-runtime":
            spec = config_from_args(manifests.RuntimeSpec, args)
            spec.image = spec.image or images.image("train")
            spec.rollout_image = spec.rollout_image or images.image("rollout")
            text = golden.to_yaml(manifests.runtime_manifest(spec, name=args.name, namespace=args.namespace),
                                  f"sao-rl runtime {args.name}")
            if args.output:
                Path(args.output).write_text(text)
            else:
                print(text, end="")
        elif action == "render":
            if args.check:
                diffs = golden.check(args.deploy_dir)
                for diff in diffs:
                    print(diff, file=sys.stderr)
                print(f"{len(diffs)} generated file(s) out of date under {args.deploy_dir}" if diffs
                      else f"generated files under {args.deploy_dir} are up to date")
                return 1 if diffs else 0
            for path in golden.write(args.deploy_dir):
                print(path)
        elif action in ("launch", "render-trainjob"):
            config = config_from_args(launcher.LaunchConfig, args)
            config.image = config.image or images.image("train")
            if not config.cluster_runtime:
                config.rollout_image = config.rollout_image or images.image("rollout")
            if action == "render-trainjob":
                runtime, trainjob = launcher.render_launch(config, config.namespace or "default")
                docs = [d for d in (runtime, trainjob) if d is not None]
                print(yaml.safe_dump_all(docs, sort_keys=False, width=110), end="")
                return 0
            api = KubeAPI.connect(api_server=args.api_server, kubeconfig=args.kubeconfig, context=args.context)
            result = launcher.launch(config, api=api)
            print(json.dumps(dataclasses.asdict(result), indent=2, default=str))
        elif action == "delete":
            api = KubeAPI.connect(api_server=args.api_server, kubeconfig=args.kubeconfig, context=args.context)
            print(json.dumps(launcher.delete_trainjob(args.name, args.namespace, api=api,
                                                      keep_completed=args.keep_completed, wait_s=args.wait_s)))
        elif action == "learner":
            return entry.run_learner(args.train_args, os.environ, args.cache_dir)
        elif action == "rollout":
            entry.serve_rollout(os.environ, args.cache_dir)
    except launcher.LaunchCancelled as err:
        print(f"sao cluster {action}: {err}", file=sys.stderr)
        return 130
    except (ClusterError, launcher.LaunchError, entry.EntryError, ConfigError, ValueError) as err:
        print(f"sao cluster {action}: error: {err}", file=sys.stderr)
        return 2
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.pipeline:
        return _demo_pipeline(args)
    from sao_core.demo import run_demo

    steps = args.steps if args.steps is not None else 300
    with _progress_bar(steps, "demo sft", args.quiet) as bar:
        summary = run_demo(args.output, args.cache_dir, steps=steps,
                           progress=lambda step, m: _advance(bar, step, m),
                           say=lambda text: bar.write(text))
    print(json.dumps(summary, indent=2))
    print(f"\nDemo outputs are in {Path(args.output).resolve()} (summary: {summary['summary_file']})")
    return 0


# ----------------------------------------------------------------------------- sao simulate (cluster simulator)
def cmd_simulate(args: argparse.Namespace) -> int:
    from sao_core.sim import commands, report
    from sao_core.sim.model import SimError

    action = args.simulate_command
    try:
        if action == "run":
            result = commands.project(config_from_args(commands.ProjectConfig, args))
            print(report.format_projection(result))
        elif action == "validate":
            result = commands.validate_results(args.results, args.output)
            print(report.format_validation(result))
        else:
            result = commands.anchors(args.output, seeds=args.seeds, scale=args.scale)
            print(report.format_anchors(result["rows"]))
    except (SimError, ConfigError, ValueError, OSError) as err:
        print(f"sao simulate {action}: error: {err}", file=sys.stderr)
        return 2
    for kind, path in result["files"].items():
        print(f"{kind}: {path}")
    return 0


# ----------------------------------------------------------------------------- sao kfp ...
def _cluster_settings(args: argparse.Namespace):
    from sao_core.kfp.k8s import ClusterSettings

    images = {kind: value for kind, value in (("cpu", args.image_cpu), ("train", args.image_train),
                                              ("rollout", args.image_rollout)) if value}
    values = {"queue_name": args.queue_name, "images": images}
    for name in ("shm_size", "training_timeout_s", "evaluation_timeout_s", "data_retries", "evaluation_retries"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return ClusterSettings(**values)


def cmd_kfp_compile(args: argparse.Namespace) -> int:
    from pipelines.commands import compile_pipelines

    names = ["post_training", "sao_rl", "evaluation"] if args.pipeline == "all" else [args.pipeline]
    for path in compile_pipelines(names, args.output_dir, _cluster_settings(args)):
        print(path)
    return 0


def cmd_kfp_upload(args: argparse.Namespace) -> int:
    from pipelines import commands

    result = commands.upload(args.host, args.name, pipeline=args.pipeline, package=args.package,
                             version_name=args.version, description=args.description, namespace=args.namespace,
                             token=commands.token_from_env(args.token_env), settings=_cluster_settings(args))
    print(json.dumps(result, indent=2))
    return 0


def cmd_kfp_run(args: argparse.Namespace) -> int:
    from pipelines import commands

    result = commands.run(args.host, args.experiment, args.run_name, args.param, pipeline=args.pipeline,
                          package=args.package, pipeline_id=args.pipeline_id, version_id=args.version_id,
                          namespace=args.namespace, token=commands.token_from_env(args.token_env),
                          enable_caching=args.cache, settings=_cluster_settings(args))
    print(json.dumps(result, indent=2))
    return 0


def cmd_kfp_schedule(args: argparse.Namespace) -> int:
    from pipelines import commands

    result = commands.schedule(args.host, args.experiment, args.name, args.cron, args.param, pipeline=args.pipeline,
                               package=args.package, pipeline_id=args.pipeline_id, version_id=args.version_id,
                               max_concurrency=args.max_concurrency, catchup=args.catchup,
                               start_time=args.start_time, end_time=args.end_time, enabled=not args.disabled,
                               namespace=args.namespace, token=commands.token_from_env(args.token_env),
                               settings=_cluster_settings(args))
    print(json.dumps(result, indent=2))
    return 0


def cmd_kfp_schedules(args: argparse.Namespace) -> int:
    from pipelines import commands

    if args.action == "list":
        rows = commands.list_schedules(args.host, args.experiment, namespace=args.namespace,
                                       token=commands.token_from_env(args.token_env))
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if not args.id:
        raise ConfigError(f"kfp schedules {args.action} needs the recurring run id")
    commands.set_schedule_enabled(args.host, args.id, args.action == "enable", namespace=args.namespace,
                                  token=commands.token_from_env(args.token_env))
    print(f"recurring run {args.id} {args.action}d")
    return 0


def _command_group(sub, name: str, help: str, dest: str, metavar: str = "ACTION"):
    """The command `name` made of actions (subcommands, one required, its name in ``args.<dest>``); returns the
    subparsers the actions are added to."""
    return sub.add_parser(name, help=help).add_subparsers(dest=dest, required=True, metavar=metavar)


def _register_kfp(sub, argv: list[str]) -> None:
    """`sao kfp` and its actions: compile, upload, run, schedule, schedules."""
    kfp_sub = _command_group(sub, "kfp", "Kubeflow Pipelines: compile, upload, run, schedule", "kfp_command")
    p = kfp_sub.add_parser("compile", help="compile pipelines to KFP YAML (method dropdown included)")
    p.add_argument("--pipeline", default="all", choices=["all", "post_training", "sao_rl", "evaluation"])
    p.add_argument("--output-dir", default="build/pipelines", help="[default: build/pipelines]")
    _add_kfp_cluster_settings(p)
    p.set_defaults(func=cmd_kfp_compile)

    p = kfp_sub.add_parser("upload", help="upload a pipeline, or a new version of an existing one")
    _add_kfp_server(p)
    p.add_argument("--name", required=True, help="pipeline name in KFP")
    p.add_argument("--pipeline", choices=["post_training", "sao_rl", "evaluation"], help="compile this pipeline")
    p.add_argument("--package", help="a compiled pipeline YAML")
    p.add_argument("--version", help="version name [default: NAME-UTC timestamp]")
    p.add_argument("--description")
    _add_kfp_cluster_settings(p)
    p.set_defaults(func=cmd_kfp_upload)

    p = kfp_sub.add_parser("run", help="start a run in an experiment")
    _add_kfp_server(p)
    p.add_argument("--experiment", required=True)
    p.add_argument("--run-name", required=True)
    _add_kfp_source(p)
    p.add_argument("--cache", action=argparse.BooleanOptionalAction, default=None,
                   help="KFP caching for this run [default: as compiled]")
    _add_kfp_cluster_settings(p)
    p.set_defaults(func=cmd_kfp_run)
    _register_kfp_schedule(kfp_sub)

    p = kfp_sub.add_parser("schedules", help="list, enable or disable recurring runs")
    _add_kfp_server(p)
    p.add_argument("action", choices=["list", "enable", "disable"])
    p.add_argument("id", nargs="?", help="recurring run id (enable / disable)")
    p.add_argument("--experiment", help="list only this experiment's")
    p.set_defaults(func=cmd_kfp_schedules)


def _register_kfp_schedule(kfp_sub) -> None:
    p = kfp_sub.add_parser("schedule", help="create a recurring run (six-field cron, seconds first)")
    _add_kfp_server(p)
    p.add_argument("--experiment", required=True)
    p.add_argument("--name", required=True, help="recurring run name")
    p.add_argument("--cron", required=True, help="six fields: seconds minutes hours day-of-month month day-of-week, "
                                                 "e.g. '0 0 2 * * *' = 02:00 daily")
    _add_kfp_source(p)
    p.add_argument("--max-concurrency", type=int, default=1, help="runs at once, 1-10 [default: 1]")
    p.add_argument("--catchup", action="store_true", help="start every missed run after a pause [default: only "
                                                           "the latest]")
    p.add_argument("--start-time", help="ISO 8601 with time zone")
    p.add_argument("--end-time", help="ISO 8601 with time zone")
    p.add_argument("--disabled", action="store_true", help="create it disabled")
    _add_kfp_cluster_settings(p)
    p.set_defaults(func=cmd_kfp_schedule)


def _add_kfp_cluster_settings(p: argparse.ArgumentParser) -> None:
    """The compile-time cluster settings (`_cluster_settings` reads them): queue, images, shm, timeouts, retries."""
    g = p.add_argument_group("compile-time cluster settings")
    g.add_argument("--queue-name", default="", help="Kueue LocalQueue: label kueue.x-k8s.io/queue-name on every pod")
    g.add_argument("--image-cpu", help="image of CPU steps [default: from SAO_IMAGE_* / sao_core.images]")
    g.add_argument("--image-train", help="image of SFT/CPT/DPO/GKD steps")
    g.add_argument("--image-rollout", help="image of RL, rollout and evaluation steps (vLLM)")
    g.add_argument("--shm-size", help="size of /dev/shm in GPU pods [default: 16Gi]")
    g.add_argument("--training-timeout-s", type=int, help="active deadline of training pods")
    g.add_argument("--evaluation-timeout-s", type=int, help="active deadline of evaluation pods")
    g.add_argument("--data-retries", type=int, help="retries of data preparation [default: 3]")
    g.add_argument("--evaluation-retries", type=int, help="retries of evaluation [default: 2]")


def _add_kfp_server(p: argparse.ArgumentParser) -> None:
    """Where the KFP API is: --host, --namespace, --token-env."""
    p.add_argument("--host", required=True, help="KFP API URL, e.g. http://localhost:8080")
    p.add_argument("--namespace", help="Kubernetes namespace (multi-user KFP)")
    p.add_argument("--token-env", default="SAO_KFP_TOKEN", help="environment variable holding a bearer token "
                                                               "[default: SAO_KFP_TOKEN]")


def _add_kfp_source(p: argparse.ArgumentParser) -> None:
    """Which pipeline a run or schedule starts (compiled here, a package, or an uploaded version) and its
    arguments."""
    p.add_argument("--pipeline", choices=["post_training", "sao_rl", "evaluation"], help="compile this pipeline")
    p.add_argument("--package", help="a compiled pipeline YAML")
    p.add_argument("--pipeline-id", help="an uploaded pipeline (with --version-id)")
    p.add_argument("--version-id", help="an uploaded pipeline version")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="pipeline argument (JSON for numbers, lists and mappings); repeat for more")


def _demo_pipeline(args: argparse.Namespace) -> int:
    from sao_core.demo import run_sao_rl_demo

    chosen = {"warm_start_steps": args.steps} if args.steps is not None else {}
    summary = run_sao_rl_demo(args.output, args.cache_dir, threads=args.threads, **chosen,
                              say=lambda text: print(text, file=sys.stderr, flush=True))
    print(json.dumps(summary, indent=2))
    held = summary["held_out"]
    print(f"\nHeld-out sampled reward (T = 1, {held['prompts']} prompts x {held['samples_per_prompt']} samples, "
          f"evaluated during training at steps {', '.join(map(str, held['steps']))}): "
          f"{held['sampled_before']:.3f} before SAO -> {held['sampled_after']:.3f} after "
          f"(greedy {held['greedy_before']:.3f} -> {held['greedy_after']:.3f})\n"
          f"HTML report: {summary['report']}\nEvaluation metrics: {summary['evaluation_summary']}\n"
          f"SAO metrics (eval_* keys: held-out rewards): {summary['sao_metrics']}\n"
          f"All outputs: {summary['output']} (summary: {summary['summary_file']}); "
          f"pipeline {summary['pipeline_seconds']:.0f} s")
    return 0

# ----------------------------------------------------------------------------- parser and main
def _method_in(argv: list[str]) -> str | None:
    """The value of --method in argv (train's flags depend on it)."""
    for i, token in enumerate(argv):
        if token == "--method" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--method="):
            return token.split("=", 1)[1]
    return None


class SaoArgumentParser(argparse.ArgumentParser):
    """argparse without option abbreviations (`--token X` must not be taken for `--token-file X`) and with
    errors that never echo the value of an unrecognised argument (it may be a secret put in the wrong place:
    the message names the options only)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            words = message[len(prefix):].split()
            shown = [w.split("=", 1)[0] + ("=..." if "=" in w else "") if w.startswith("-") else "..." for w in words]
            message = prefix + " ".join(shown) + " (values not shown)"
        super().error(message)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `sao` parser: the global options, then one registration per command (`COMMANDS`, in --help order).
    `argv` picks `sao train`'s flags (they depend on --method)."""
    parser = SaoArgumentParser(prog="sao", description="SAO and LLM post-training on Kubeflow Pipelines.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--cache-dir", default=default_cache_dir(),
                        help="models and downloads cache [default: $SAO_CACHE_DIR or ~/.cache/sao]")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads [default: torch's choice]")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(sub, argv or [])
    _describe(parser)
    _compact_usage(parser)
    return parser


def _register_build_model(sub, argv: list[str]) -> None:
    p = sub.add_parser("build-model", help="build (or reuse) the embedded tiny model and print its directory")
    p.add_argument("--publish", metavar="URI", help="also publish it as a checkpoint to a path or s3:// prefix")
    p.set_defaults(func=cmd_build_model)


def _add_config_command(sub, name: str, help: str, config: type, func: Callable[[argparse.Namespace], int],
                        title: str = "") -> argparse.ArgumentParser:
    """The subcommand `name` whose flags are the settings of the dataclass `config` (`add_config_arguments`; its
    `cache_dir` comes from the global --cache-dir), run by `func`; returned for any flags of its own."""
    p = sub.add_parser(name, help=help)
    add_config_arguments(p, config, skip=("cache_dir",), title=title)
    p.set_defaults(func=func)
    return p


def _register_prepare_data(sub, argv: list[str]) -> None:
    from sao_core.data.prepare import PrepareConfig

    _add_config_command(sub, "prepare-data", "normalise a dataset (sft, cpt, dpo, rl or a benchmark) with rejects "
                                             "and stats", PrepareConfig, cmd_prepare_data, title="data preparation")


def _register_train(sub, argv: list[str]) -> None:
    """`sao train`: its settings are those of the method named by --method in `argv` (TrainConfig's if none)."""
    from sao_core.training.config import METHOD_CONFIGS, TrainConfig

    p = sub.add_parser("train", help="train with sft, cpt, dpo or gkd from a prepared dataset to an exported model",
                       description="Flags after --method depend on the method: "
                                   "`sao train --method dpo --help` lists DPO's.")
    p.add_argument("--method", required=True, choices=sorted(METHOD_CONFIGS), help="training method")
    add_config_arguments(p, METHOD_CONFIGS.get(_method_in(argv), TrainConfig), skip=("cache_dir",))
    p.set_defaults(func=cmd_train)


def _register_train_rl(sub, argv: list[str]) -> None:
    from sao_core.learner.config import RLConfig

    _add_config_command(sub, "train-rl", "RL with SAO or a GRPO baseline against rollout services (colocated by "
                                         "default)", RLConfig, cmd_train_rl)


def _register_rollout(sub, argv: list[str]) -> None:
    from sao_core.rollout.server import ServeConfig

    rollout_sub = _command_group(sub, "rollout", "the rollout service (engine + environments over HTTP)",
                                 "rollout_command")
    p = _add_config_command(rollout_sub, "serve", "serve episodes and trajectories over HTTP until shut down",
                            ServeConfig, cmd_rollout_serve, title="rollout service")
    p.add_argument("--plan", metavar="YAML", help="start this rollout plan at once (RolloutPlan fields: dataset, "
                                                  "rollouts_per_prompt, epochs, max_in_flight, ...)")


def _register_checkpoint(sub, argv: list[str]) -> None:
    from sao_core.training.merge import MERGE_DTYPES

    checkpoint_sub = _command_group(sub, "checkpoint", "publish, verify or find the latest checkpoint (path or "
                                                       "s3://); merge a LoRA adapter into its base model", "action")
    p = checkpoint_sub.add_parser("publish", help="publish a local directory as a checkpoint (manifest, _COMPLETE)")
    p.add_argument("uri", help="destination (path or s3://)")
    p.add_argument("--source", help="local directory to publish")
    p = checkpoint_sub.add_parser("verify", help="fetch a checkpoint and check every file against its manifest")
    p.add_argument("uri", help="checkpoint (path or s3://)")
    p = checkpoint_sub.add_parser("latest", help="print the newest complete checkpoint under a root")
    p.add_argument("uri", metavar="ROOT", help="the root holding checkpoints (path or s3://)")
    p = checkpoint_sub.add_parser("merge", help="merge a LoRA adapter into its base model and publish the full "
                                                "model as a checkpoint; print model, sha256, base and adapter (JSON)")
    p.add_argument("--base", required=True, metavar="MODEL", help="the base model the adapter was trained on: "
                                                                   "embedded:tiny, a directory, s3:// or a hub id")
    p.add_argument("--adapter", required=True, metavar="ADAPTER", help="LoRA adapter (peft folder): a directory "
                                                                       "with a manifest or an s3:// checkpoint, "
                                                                       "e.g. a LoRA run's OUTPUT/weights/vNNNNNN")
    p.add_argument("--output", required=True, metavar="URI", help="where the merged model is published (a new "
                                                                  "folder or an s3:// prefix)")
    p.add_argument("--dtype", default="auto", choices=MERGE_DTYPES,
                   help="dtype of the merged weights [default: auto, the base's]")
    p.add_argument("--unverified", action="store_true", help="accept an adapter or base folder without a "
                                                             "manifest.json (as it is)")
    for p in checkpoint_sub.choices.values():
        p.set_defaults(func=cmd_checkpoint)


def _register_evaluate(sub, argv: list[str]) -> None:
    from sao_core.eval.config import EvalConfig

    _add_config_command(sub, "evaluate", "evaluate a model on SWE-Bench Verified, BeyondAIME and IMO-AnswerBench "
                                         "(samples, summary, metrics, HTML report)", EvalConfig, cmd_evaluate)


def _register_judge_agreement(sub, argv: list[str]) -> None:
    """`sao judge-agreement`: its judge flags default to EvalConfig's judge settings."""
    from sao_core.eval.config import EvalConfig
    from sao_core.eval.judge import JUDGE_APIS

    judge_defaults = {f.name: f.default for f in dataclasses.fields(EvalConfig)}
    p = sub.add_parser("judge-agreement", help="run an LLM judge over a labelled set of IMO answer pairs (equal or "
                                               "not) and report its agreement and every disagreement")
    p.add_argument("--judge-url", required=True, help="an OpenAI-compatible API base (…/v1) or a rollout service")
    p.add_argument("--judge-model", default="judge", help="the model name sent (rollout: only a label) [default: judge]")
    p.add_argument("--judge-api", choices=JUDGE_APIS, default=judge_defaults["judge_api"],
                   help=f"[default: {judge_defaults['judge_api']}]")
    p.add_argument("--judge-api-key-env", default=judge_defaults["judge_api_key_env"],
                   help="environment variable holding the judge's key / the service's token "
                        f"[default: {judge_defaults['judge_api_key_env']}]")
    p.add_argument("--labelled", default=None, help="JSON lines of {reference, answer, equal, problem?, note?} "
                                                    "[default: the built-in set, sao_core/eval/judge_labelled.jsonl]")
    p.add_argument("--max-tokens", type=int, default=4096, help="reply length limit in tokens [default: 4096]")
    p.add_argument("--timeout-s", type=float, default=judge_defaults["judge_timeout_s"],
                   help="deadline of one judge request, connect to last byte, seconds (a request past it is "
                        f"not retried) [default: {judge_defaults['judge_timeout_s']:g}]")
    p.add_argument("--concurrency", type=int, default=judge_defaults["judge_concurrency"],
                   help=f"judge requests in flight [default: {judge_defaults['judge_concurrency']}]")
    p.add_argument("--output", default=None, help="write the whole report (with the disagreements) here as JSON")
    p.set_defaults(func=cmd_judge_agreement)


def _register_report(sub, argv: list[str]) -> None:
    report_sub = _command_group(sub, "report", "HTML reports of runs", "report_command", metavar="KIND")
    p = report_sub.add_parser("training", help="the training report of a run directory (path or s3://): loss / "
                                               "reward and RL health curves, config, checkpoints")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output (holds metrics.jsonl)")
    p.add_argument("--output", metavar="FILE", default=None,
                   help="where the HTML goes (path or s3://) [default: RUN_DIR/training_report.html]")
    p.set_defaults(func=cmd_report)


def _register_cluster(sub, argv: list[str]) -> None:
    from sao_core.cluster.launcher import LaunchConfig
    from sao_core.cluster.manifests import RuntimeSpec

    cluster_sub = _command_group(sub, "cluster", "multi-node SAO as one Kubeflow Trainer TrainJob: manifests, "
                                                 "launch, delete, and the programs its pods run", "cluster_command")
    p = cluster_sub.add_parser("render-runtime", help="print a sao-rl ClusterTrainingRuntime (or, with --namespace, "
                                                      "a TrainingRuntime) of the given shape as YAML")
    p.add_argument("--name", default="sao-rl", help="runtime name [default: sao-rl]")
    p.add_argument("--namespace", default=None, help="render a namespaced TrainingRuntime in this namespace")
    p.add_argument("--output", metavar="FILE", help="write to FILE instead of stdout")
    add_config_arguments(p, RuntimeSpec)
    p = cluster_sub.add_parser("render", help="regenerate the generated manifests under deploy/ (golden files)")
    p.add_argument("--deploy-dir", default="deploy", help="[default: deploy]")
    p.add_argument("--check", action="store_true", help="only compare; exit 1 and print the diff when out of date")
    for name, text in (("launch", "create a TrainJob for an RL run, follow it to the end, print the final model"),
                       ("render-trainjob", "print the TrainJob (and per-run runtime) `launch` would create, as YAML")):
        p = cluster_sub.add_parser(name, help=text)
        add_config_arguments(p, LaunchConfig)
        if name == "launch":
            _add_kube_connection(p)
    p = cluster_sub.add_parser("delete", help="delete a TrainJob and its per-run runtime (a missing one is fine)")
    p.add_argument("name", help="TrainJob name")
    p.add_argument("--namespace", default="", help="[default: in-cluster namespace or the kubeconfig context's]")
    p.add_argument("--keep-completed", action="store_true", help="keep it when it completed successfully")
    p.add_argument("--wait-s", type=float, default=0.0, help="wait up to this many seconds until it is gone")
    _add_kube_connection(p)
    p = cluster_sub.add_parser("learner", help="in a TrainJob's node pod: wait for the rollout replicas, run torchrun "
                                               "train-rl against them, shut them down")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- followed by sao train-rl arguments")
    p = cluster_sub.add_parser("rollout", help="in a TrainJob's rollout pod: serve rollouts (settings from SAO_* env)")
    for p in cluster_sub.choices.values():
        p.set_defaults(func=cmd_cluster)


def _add_kube_connection(p: argparse.ArgumentParser) -> None:
    """--api-server, --kubeconfig and --context: how `sao cluster launch` / `delete` reach the cluster."""
    p.add_argument("--api-server", default="", help="API server URL (default: in-cluster, else kubeconfig)")
    p.add_argument("--kubeconfig", default="", help="kubeconfig file [default: $KUBECONFIG or ~/.kube/config]")
    p.add_argument("--context", default="", help="kubeconfig context")


def _register_simulate(sub, argv: list[str]) -> None:
    from sao_core.sim.commands import ProjectConfig

    simulate_sub = _command_group(sub, "simulate", "discrete-event cluster simulator: sync GRPO vs SAO "
                                                   "projections, validation against measured runs and published "
                                                   "anchors", "simulate_command")
    p = simulate_sub.add_parser("run", help="project sync GRPO (G) and SAO (S) on one cluster: busy / idle shares "
                                            "per role, trajectories/hour, GPU-hours per 1,000, staleness")
    add_config_arguments(p, ProjectConfig, title="simulated cluster and workload")
    p = simulate_sub.add_parser("validate", help="predicted vs measured trajectories/s for a "
                                                 "bench/async_vs_sync.py result")
    p.add_argument("results", help="async_vs_sync.json written by bench/async_vs_sync.py")
    p.add_argument("--output", metavar="DIR", help="where simulator_validation.json/.png go [default: next to "
                                                   "RESULTS]")
    p = simulate_sub.add_parser("anchors", help="published async-vs-sync speed-ups (AReaL, verl, ROLL Flash), "
                                                "reconstructed")
    p.add_argument("--output", metavar="DIR", default="local_outputs/bench/simulator",
                   help="[default: local_outputs/bench/simulator]")
    p.add_argument("--seeds", type=int, default=3, help="runs per method [default: 3]")
    p.add_argument("--scale", type=int, default=1, help="divide batch sizes and GPU counts by this (quicker) "
                                                        "[default: 1]")
    for p in simulate_sub.choices.values():
        p.set_defaults(func=cmd_simulate)


def _register_demo(sub, argv: list[str]) -> None:
    p = sub.add_parser("demo", help="demos on the embedded tiny model, on CPU: with --pipeline (what `make demo` "
                                    "runs) the whole sao_rl pipeline locally (data, SFT warm start, SAO RL with "
                                    "held-out evaluation, benchmark evaluation, HTML report); without it a short SFT "
                                    "run (data preparation, SFT, checkpoint, tool-call accuracy)")
    p.add_argument("--output", default="local_outputs/demo", help="output directory [default: local_outputs/demo]")
    p.add_argument("--steps", type=int, default=None, help="SFT steps [default: 300; with --pipeline the "
                                                            "warm start's, 190]")
    p.add_argument("--pipeline", action="store_true", help="run the sao_rl Kubeflow pipeline locally instead: "
                                                           "SFT warm start, SAO, evaluation, HTML report")
    p.set_defaults(func=cmd_demo)


#: One registration per `sao` command, in the order --help lists them: each adds its subparser (flags, help and
#: handler) to the subcommands of the `sao` parser; `argv` is the command line (only `train` reads it).
COMMANDS: tuple[Callable[[Any, list[str]], None], ...] = (
    _register_build_model, _register_prepare_data, _register_train, _register_train_rl, _register_rollout,
    _register_checkpoint, _register_evaluate, _register_judge_agreement, _register_report, _register_cluster,
    _register_simulate, _register_demo, _register_kfp,
)


def _describe(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand its one-line `help` as the first line of its --help (`description`), before any
    description it already has; recurses."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, child in action.choices.items():
            line = helps.get(name)
            if line and not (child.description or "").startswith(line):
                line = line[0].upper() + line[1:] + ("" if line.endswith(".") else ".")
                child.description = f"{line} {child.description}" if child.description else line
            _describe(child)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sao` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one progress bar per command is enough
    except ImportError:
        pass
    from sao_core.data.prepare import DataError
    from sao_core.kfp.client import KFPError
    from sao_core.kfp.local import LocalRunError
    from sao_core.learner.loop import LearnerError
    from sao_core.models import ModelLoadError
    from sao_core.reporting.training import ReportError
    from sao_core.storage import StorageError
    from sao_core.training.trainer import TrainingError

    try:
        return args.func(args)
    except (ConfigError, DataError, ModelLoadError, StorageError, TrainingError, LearnerError, KFPError,
            LocalRunError, ReportError, ValueError,
            FileNotFoundError, ConnectionError) as err:
        print(f"sao {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sao {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
