"""delete_trainjob: the ExitHandler step of ``placement=trainjob``: delete the run's TrainJob, whatever happened.

Calls :func:`sao_core.cluster.launcher.delete_trainjob`. The TrainJob's name is derived from the run id
and stage exactly as ``launch_trainjob`` derives it (``sao-STAGE-RUN_ID``), so the exit step needs no
output of the launcher (an ExitHandler's exit task cannot depend on the tasks it guards). A TrainJob
that is already gone is fine: the step is idempotent, and runs after a successful launch too.

KFP does not let a task outside a ``dsl.ExitHandler`` consume an output of a task inside it, so this
step also hands the trained model on: with ``output_root`` it returns ``OUTPUT_ROOT/RUN_ID/STAGE/model``
when that checkpoint is complete, and fails (after deleting) when it is not, so the steps after it
(evaluation) run only after a successful TrainJob.
"""

from typing import NamedTuple

from kfp import dsl

from sao_core.images import image


@dsl.component(base_image=image("cpu"), install_kfp_package=False)
def delete_trainjob(run_id: str, stage: str = "sao", name: str = "", namespace: str = "", output_root: str = "",
                    keep_completed: bool = False, wait_s: float = 60.0
                    ) -> NamedTuple("CleanupOutputs", model_uri=str, result=str):
    """Delete the TrainJob (and its per-run runtime) of a pipeline stage; a missing one is fine.

    Args:
        run_id: Pipeline run id (dsl.PIPELINE_JOB_ID_PLACEHOLDER), as given to launch_trainjob.
        stage: Stage name, as given to launch_trainjob.
        name: Explicit TrainJob name ('' = derived from run_id and stage).
        namespace: Namespace of the TrainJob ('' = this pod's namespace).
        output_root: The launch's output_root: return its final model and fail when there is none ('' = do not check).
        keep_completed: Keep a TrainJob that completed successfully (for inspection).
        wait_s: Wait up to this many seconds until the TrainJob is gone.

    Returns:
        model_uri: OUTPUT_ROOT/RUN_ID/STAGE/model ('' without output_root).
        result: What happened, as JSON: {"name", "trainjob": deleted?, "runtime": deleted?, "kept", "state"}.
    """
    import json

    from sao_core import storage
    from sao_core.cluster import names
    from sao_core.cluster.launcher import LaunchError
    from sao_core.cluster.launcher import delete_trainjob as delete
    from sao_core.kfp import artifacts

    target = name or names.trainjob_name(run_id, stage)
    result = delete(target, namespace, keep_completed=keep_completed, wait_s=wait_s)
    report = json.dumps({"name": target, **result}, sort_keys=True)
    print(f"TrainJob {namespace or '(pod namespace)'}/{target}: {report}")
    model_uri = ""
    if output_root:
        model_uri = storage.join(artifacts.run_dir(output_root, run_id, stage), "model")
        if not storage.is_complete_checkpoint(model_uri):
            raise LaunchError(f"TrainJob {target} left no complete model at {model_uri}: the training step failed or "
                              "was cancelled (see its log); the TrainJob has been deleted")
    outputs = NamedTuple("CleanupOutputs", model_uri=str, result=str)  # noqa: UP014 (as declared)
    return outputs(model_uri, report)
