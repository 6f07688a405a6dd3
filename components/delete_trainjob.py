"""delete_trainjob: the ExitHandler step of ``placement=trainjob``: delete the run's TrainJob, whatever happened.

Calls :func:`sao_core.cluster.launcher.delete_trainjob`. The TrainJob's name is derived from the run id
and stage exactly as ``launch_trainjob`` derives it (``sao-STAGE-RUN_ID``), so the exit step needs no
output of the launcher (an ExitHandler's exit task cannot depend on the tasks it guards). A TrainJob
that is already gone is fine: this step is idempotent, and succeeds after a normal run too.
"""

from kfp import dsl

from sao_core.kfp.images import image


@dsl.component(base_image=image("cpu"), install_kfp_package=False)
def delete_trainjob(run_id: str, stage: str = "sao", name: str = "", namespace: str = "",
                    keep_completed: bool = False, wait_s: float = 60.0) -> str:
    """Delete the TrainJob (and its per-run runtime) of a pipeline stage; a missing one is fine.

    Args:
        run_id: Pipeline run id (dsl.PIPELINE_JOB_ID_PLACEHOLDER), as given to launch_trainjob.
        stage: Stage name, as given to launch_trainjob.
        name: Explicit TrainJob name ('' = derived from run_id and stage).
        namespace: Namespace of the TrainJob ('' = this pod's namespace).
        keep_completed: Keep a TrainJob that completed successfully (for inspection).
        wait_s: Wait up to this many seconds until the TrainJob is gone.

    Returns:
        What happened, as JSON: {"trainjob": deleted?, "runtime": deleted?, "kept": bool, "state": last state}.
    """
    import json

    from sao_core.cluster import names
    from sao_core.cluster.launcher import delete_trainjob as delete

    target = name or names.trainjob_name(run_id, stage)
    result = delete(target, namespace, keep_completed=keep_completed, wait_s=wait_s)
    print(f"TrainJob {namespace or '(pod namespace)'}/{target}: {json.dumps(result)}")
    return json.dumps({"name": target, **result}, sort_keys=True)
