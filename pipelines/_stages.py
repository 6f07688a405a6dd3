"""Sub-pipelines shared by the pipelines: RL training with an optional SFT warm start, in one pod or as a
Kubeflow Trainer TrainJob, and the evaluation stage.

KFP's ``dsl.OneOf`` cannot be nested and the local runner only resolves it for parameters, so every
choice is its own small pipeline whose output is the trained model's URI (a string):

- ``single_pod`` RL stage: ``If(warm_start_steps > 0)``: prepare the SFT data, fine-tune, then RL from
  the fine-tuned model; ``Else``: RL from ``base_model`` (the rollout service and the learner share one
  pod);
- ``trainjob`` RL stage: the same warm start, but the RL step is :func:`build_trainjob_stage`: a CPU pod
  launches one TrainJob (rollout replicas + torchrun learner, one Kueue workload) and follows it, inside
  a ``dsl.ExitHandler`` whose exit step deletes the TrainJob whatever happens;
- the RL stage the pipelines call: ``If(placement == "trainjob")`` runs the TrainJob stage, ``Else`` the
  single-pod stage. Local runs (``placement=single_pod``) never enter the TrainJob branch, so they need
  no cluster.
"""

from kfp import dsl, kubernetes
from kfp.dsl import Dataset, Input

from components.grpo import grpo_train
from components.prepare_data import prepare_data
from components.sao import sao_train
from components.sft import sft_train
from sao_core.kfp import k8s

RUN_ID = dsl.PIPELINE_JOB_ID_PLACEHOLDER
#: SAO settings that sao_rl passes as parameters of their own (post_training passes them in method_options).
SAO_PARAMETERS = ("max_staleness", "admission", "eps_low", "eps_high")


def warm_start_sft(base_model, output_root, warm_start_source, warm_start_steps, params: k8s.ClusterParams,
                   settings: k8s.ClusterSettings, lr=None, max_tokens=None, batch_size=None, options=None):
    """The warm-start tasks (prepare the SFT data, fine-tune `base_model`); returns the SFT task.

    Call it inside a pipeline function (usually in ``dsl.If(warm_start_steps > 0)``); the SFT step runs
    in one training pod with ``params``' GPUs whatever the RL placement. `lr`, `max_tokens`, `batch_size`
    None: sft_train's defaults (which `options`, other SFTConfig settings, may replace).
    """
    warm_data = prepare_data(source=warm_start_source, kind="sft").set_display_name("prepare warm-start data")
    k8s.apply(warm_data, "data", params, settings, image_kind="cpu")
    given = {"lr": lr, "max_tokens": max_tokens, "batch_size": batch_size, "options": options}
    warm = sft_train(data=warm_data.outputs["dataset"], output_root=output_root, base_model=base_model,
                     steps=warm_start_steps, run_id=RUN_ID,
                     **{k: v for k, v in given.items() if v is not None}).set_display_name("warm-start SFT")
    return k8s.apply(warm, "training", params, settings, image_kind="train")


def build_trainjob_stage(settings: k8s.ClusterSettings, stage: str = "sao", sao_parameters: bool = False):
    """RL as one TrainJob (``placement=trainjob``), as a graph component returning the trained model's URI.

    ``delete_trainjob`` is the exit task and ``launch_trainjob`` runs inside ``dsl.ExitHandler(cleanup)``:
    the TrainJob is deleted when the run succeeds, fails or is cancelled. KFP lets no task outside an
    ExitHandler read an output of a task inside it, so the exit task hands the model on
    (``OUTPUT_ROOT/RUN_ID/STAGE/model``; it fails when that checkpoint is incomplete). The launcher runs
    on a small CPU pod (no GPU, no GPU node) with the training deadline (the cpu role's 1 h would kill
    it); neither step is cached. The TrainJob's pods get the Kueue queue, the images and the shape.

    `stage` must be the run-directory name the single-pod component uses ("sao" for SAO, the method
    name for the GRPO family) so both placements write OUTPUT_ROOT/RUN_ID/STAGE. `sao_parameters`
    adds sao_rl's explicit SAO settings (:data:`SAO_PARAMETERS`) as inputs, passed to the launcher as
    sao_train gets them.
    """
    from components.delete_trainjob import delete_trainjob
    from components.launch_trainjob import launch_trainjob

    if sao_parameters and stage != "sao":
        raise ValueError(f"sao_parameters applies to the sao stage only, got stage {stage!r}")

    def guarded_launch(data, output_root, base_model, method, steps, batch_size, learning_rate, engine,
                       method_options, num_nodes, gpus_per_node, rollout_replicas, rollout_gpus,
                       tensor_parallel_size, accelerator_type, node_selector, tolerations, s3_secret_name, **sao):
        params = k8s.ClusterParams(s3_secret_name=s3_secret_name)
        cleanup = delete_trainjob(run_id=RUN_ID, stage=stage, output_root=output_root).set_display_name(
            "delete trainjob")
        k8s.apply(cleanup, "cpu", params, settings, image_kind="cpu")
        cleanup.set_caching_options(False)  # it deletes a cluster object and checks the model: always run it
        with dsl.ExitHandler(cleanup, name="trainjob"):
            launch = launch_trainjob(
                data=data, output_root=output_root, method=method, base_model=base_model, steps=steps,
                batch_size=batch_size, policy_lr=learning_rate, engine=engine, options=method_options, run_id=RUN_ID,
                stage=stage, queue_name=settings.queue_name, learner_image=settings.image("train"),
                rollout_image=settings.image("rollout"), num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                tensor_parallel_size=tensor_parallel_size, accelerator_type=accelerator_type,
                node_selector=node_selector, tolerations=tolerations, s3_secret_name=s3_secret_name,
                timeout_s=float(settings.training_timeout_s), **sao).set_display_name(f"{stage} trainjob")
            k8s.apply(launch, "cpu", params, settings, image_kind="cpu")  # a CPU pod: no GPU, no GPU node
            kubernetes.set_timeout(launch, settings.training_timeout_s)  # it lives as long as the training
            launch.set_caching_options(False)
        return cleanup.outputs["model_uri"]

    if not sao_parameters:
        @dsl.pipeline(name=f"{stage}-trainjob-stage")
        def trainjob_stage(data: Input[Dataset], output_root: str, base_model: str, method: str, steps: int,
                           batch_size: int, learning_rate: float, engine: str, method_options: dict,
                           num_nodes: int, gpus_per_node: int, rollout_replicas: int, rollout_gpus: int,
                           tensor_parallel_size: int, accelerator_type: str, node_selector: dict, tolerations: list,
                           s3_secret_name: str) -> str:
            """RL as one TrainJob; the exit step deletes it whatever happens and returns the trained model's URI.

            Args:
                data: Prepared rl dataset.
                output_root: s3://bucket/prefix; the TrainJob writes OUTPUT_ROOT/RUN_ID/STAGE.
                base_model: Model to start from (an s3:// checkpoint or a hub id the pods can reach).
                method: RL method: sao, grpo (synchronous), grpo_async, grpo_dis or running_mean.
                steps: Optimiser steps (RL: learner steps) in total.
                batch_size: Trajectories per step (B), one per prompt (GRPO: groups of group_size).
                learning_rate: Policy learning rate.
                engine: Rollout engine: vllm (GPU) or hf (transformers; small models, CPU).
                method_options: Other RLConfig fields.
                num_nodes: Learner nodes (pods of the node job); torchrun --nnodes.
                gpus_per_node: GPUs per learner node = torchrun processes per node (0: one CPU process).
                rollout_replicas: Rollout service replicas (one pod and one Job each).
                rollout_gpus: GPUs per rollout replica (vllm: tensor_parallel_size x data_parallel_size).
                tensor_parallel_size: VLLM tensor-parallel size inside one replica.
                accelerator_type: Kubernetes resource name of the GPUs, e.g. nvidia.com/gpu.
                node_selector: Node labels the GPU pods require (a TrainJob: every pod), e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}.
                tolerations: Tolerations of the GPU pods (a TrainJob: every pod), e.g. [{"key": "nvidia.com/gpu", "operator": "Exists"}].
                s3_secret_name: Kubernetes Secret with the S3 credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (+ AWS_ENDPOINT_URL, AWS_DEFAULT_REGION).
            """
            return guarded_launch(data, output_root, base_model, method, steps, batch_size, learning_rate, engine,
                                  method_options, num_nodes, gpus_per_node, rollout_replicas, rollout_gpus,
                                  tensor_parallel_size, accelerator_type, node_selector, tolerations, s3_secret_name)

        return trainjob_stage

    @dsl.pipeline(name=f"{stage}-trainjob-stage")
    def sao_trainjob_stage(data: Input[Dataset], output_root: str, base_model: str, method: str, steps: int,
                           batch_size: int, learning_rate: float, max_staleness: int, admission: str, eps_low: float,
                           eps_high: float, engine: str, method_options: dict, num_nodes: int, gpus_per_node: int,
                           rollout_replicas: int, rollout_gpus: int, tensor_parallel_size: int, accelerator_type: str,
                           node_selector: dict, tolerations: list, s3_secret_name: str) -> str:
        """SAO as one TrainJob; the exit step deletes it whatever happens and returns the trained model's URI.

        Args:
            data: Prepared rl dataset.
            output_root: s3://bucket/prefix; the TrainJob writes OUTPUT_ROOT/RUN_ID/sao.
            base_model: Model to start from (an s3:// checkpoint or a hub id the pods can reach).
            method: RL method: sao, grpo (synchronous), grpo_async, grpo_dis or running_mean.
            steps: Optimiser steps (RL: learner steps) in total.
            batch_size: Trajectories per step (B), one per prompt (GRPO: groups of group_size).
            learning_rate: Policy learning rate.
            max_staleness: S, the most weights versions a trained token may lag (window / version_order / requeue drop trajectories beyond it; no_drop / fragments drop only past the safety bound).
            admission: How the run admits episodes and batches them: no_drop, window, version_order, requeue or fragments. no_drop (the default): arrival order, nothing dropped or waited for, the early tokens of long episodes may lag more than S (DIS guards them; an episode older than the safety bound hard_staleness, default 4·S, is dropped); window: (S+1)·B episodes in flight, trained in arrival order, stale ones dropped; version_order: the oldest admission cohort first, never an episode admitted after one still running (nothing stale; the learner waits for each cohort); requeue: window, and a prompt dropped as stale is rolled out once more; fragments (sao only): long episodes are trained in pieces cut at turn boundaries, advantages bootstrapped from the critic (fewer tokens beyond S than no_drop, at a lower throughput).
            eps_low: DIS band lower width: tokens with ratio <= 1 - eps_low are masked (0.3 math with tools, 0.8 agentic coding).
            eps_high: DIS band upper width: tokens with ratio >= 1 + eps_high are masked (5.0 math with tools, 3.0 agentic coding).
            engine: Rollout engine: vllm (GPU) or hf (transformers; small models, CPU).
            method_options: Other RLConfig fields.
            num_nodes: Learner nodes (pods of the node job); torchrun --nnodes.
            gpus_per_node: GPUs per learner node = torchrun processes per node (0: one CPU process).
            rollout_replicas: Rollout service replicas (one pod and one Job each).
            rollout_gpus: GPUs per rollout replica (vllm: tensor_parallel_size x data_parallel_size).
            tensor_parallel_size: VLLM tensor-parallel size inside one replica.
            accelerator_type: Kubernetes resource name of the GPUs, e.g. nvidia.com/gpu.
            node_selector: Node labels the GPU pods require (a TrainJob: every pod), e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}.
            tolerations: Tolerations of the GPU pods (a TrainJob: every pod), e.g. [{"key": "nvidia.com/gpu", "operator": "Exists"}].
            s3_secret_name: Kubernetes Secret with the S3 credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (+ AWS_ENDPOINT_URL, AWS_DEFAULT_REGION).
        """
        return guarded_launch(data, output_root, base_model, method, steps, batch_size, learning_rate, engine,
                              method_options, num_nodes, gpus_per_node, rollout_replicas, rollout_gpus,
                              tensor_parallel_size, accelerator_type, node_selector, tolerations, s3_secret_name,
                              max_staleness=max_staleness, admission=admission, eps_low=eps_low, eps_high=eps_high)

    return sao_trainjob_stage


def build_rl_stage(method: str, settings: k8s.ClusterSettings):
    """The `method` ('sao' or 'grpo') RL stage with an optional warm start and a placement, as a graph component."""
    if method not in ("sao", "grpo"):
        raise ValueError(f"RL stage method must be sao or grpo, got {method!r}")
    rl_component = sao_train if method == "sao" else grpo_train
    trainjob_stage = build_trainjob_stage(settings, stage=method)  # grpo_train writes to RUN_ID/<method>

    def rl_task(data, base_model, output_root, steps, batch_size, learning_rate, engine, method_options, params):
        kwargs = dict(data=data, output_root=output_root, base_model=base_model, steps=steps, batch_size=batch_size,
                      policy_lr=learning_rate, engine=engine, options=method_options, run_id=RUN_ID)
        if method == "grpo":
            kwargs["method"] = "grpo"
        task = rl_component(**kwargs).set_display_name(f"{method} training")
        return k8s.apply(task, "training", params, settings, image_kind="rollout")

    @dsl.pipeline(name=f"{method}-single-pod-stage")
    def single_pod_rl_stage(
        data: Input[Dataset],
        output_root: str,
        base_model: str,
        steps: int,
        batch_size: int,
        learning_rate: float,
        engine: str,
        method_options: dict,
        warm_start_source: str,
        warm_start_steps: int,
        warm_start_lr: float,
        max_tokens: int,
        gpu_count: int,
        accelerator_type: str,
        node_selector: dict,
        tolerations: list,
        s3_secret_name: str,
    ) -> str:
        """RL in one pod (colocated rollout service) with an optional SFT warm start; returns the model's URI.

        Args:
            data: Prepared rl dataset.
            output_root: Where runs are written (s3://bucket/prefix or a local directory).
            base_model: Model to start from.
            steps: RL learner steps.
            batch_size: Trajectories per step.
            learning_rate: Policy learning rate.
            engine: Rollout engine: vllm or hf.
            method_options: Other RLConfig fields.
            warm_start_source: SFT data source of the warm start.
            warm_start_steps: SFT steps before RL (0 = no warm start).
            warm_start_lr: Learning rate of the warm start.
            max_tokens: Token limit of warm-start examples.
            gpu_count: GPUs of the training pods.
            accelerator_type: Kubernetes resource name of the GPUs.
            node_selector: Node labels the training pods require.
            tolerations: Tolerations of the training pods.
            s3_secret_name: Secret with the S3 credentials.
        """
        params = k8s.ClusterParams(gpu_count=gpu_count, accelerator_type=accelerator_type,
                                   node_selector=node_selector, tolerations=tolerations,
                                   s3_secret_name=s3_secret_name)
        with dsl.If(warm_start_steps > 0, name="warm-start"):
            warm = warm_start_sft(base_model, output_root, warm_start_source, warm_start_steps, params, settings,
                                  lr=warm_start_lr, max_tokens=max_tokens)
            after_warm = rl_task(data, warm.outputs["model_uri"], output_root, steps, batch_size, learning_rate,
                                 engine, method_options, params)
        with dsl.Else(name="no-warm-start"):
            cold = rl_task(data, base_model, output_root, steps, batch_size, learning_rate, engine, method_options,
                           params)
        return dsl.OneOf(after_warm.outputs["model_uri"], cold.outputs["model_uri"])

    @dsl.pipeline(name=f"{method}-trainjob-rl-stage")
    def trainjob_rl_stage(
        data: Input[Dataset],
        output_root: str,
        base_model: str,
        steps: int,
        batch_size: int,
        learning_rate: float,
        engine: str,
        method_options: dict,
        warm_start_source: str,
        warm_start_steps: int,
        warm_start_lr: float,
        max_tokens: int,
        num_nodes: int,
        gpus_per_node: int,
        rollout_replicas: int,
        rollout_gpus: int,
        tensor_parallel_size: int,
        gpu_count: int,
        accelerator_type: str,
        node_selector: dict,
        tolerations: list,
        s3_secret_name: str,
    ) -> str:
        """RL as one TrainJob with an optional SFT warm start (in one pod); returns the trained model's URI.

        Args:
            data: Prepared rl dataset.
            output_root: s3://bucket/prefix where runs are written.
            base_model: Model to start from.
            steps: RL learner steps.
            batch_size: Trajectories per step.
            learning_rate: Policy learning rate.
            engine: Rollout engine: vllm or hf.
            method_options: Other RLConfig fields.
            warm_start_source: SFT data source of the warm start.
            warm_start_steps: SFT steps before RL (0 = no warm start).
            warm_start_lr: Learning rate of the warm start.
            max_tokens: Token limit of warm-start examples.
            num_nodes: Learner nodes of the TrainJob.
            gpus_per_node: GPUs per learner node.
            rollout_replicas: Rollout service replicas of the TrainJob.
            rollout_gpus: GPUs per rollout replica.
            tensor_parallel_size: vLLM tensor-parallel size inside a replica.
            gpu_count: GPUs of the warm-start SFT pod.
            accelerator_type: Kubernetes resource name of the GPUs.
            node_selector: Node labels the GPU pods require.
            tolerations: Tolerations of the GPU pods.
            s3_secret_name: Secret with the S3 credentials.
        """
        params = k8s.ClusterParams(gpu_count=gpu_count, accelerator_type=accelerator_type,
                                   node_selector=node_selector, tolerations=tolerations,
                                   s3_secret_name=s3_secret_name)
        rl = dict(data=data, output_root=output_root, method=method, steps=steps, batch_size=batch_size,
                  learning_rate=learning_rate, engine=engine, method_options=method_options, num_nodes=num_nodes,
                  gpus_per_node=gpus_per_node, rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                  tensor_parallel_size=tensor_parallel_size, accelerator_type=accelerator_type,
                  node_selector=node_selector, tolerations=tolerations, s3_secret_name=s3_secret_name)
        with dsl.If(warm_start_steps > 0, name="warm-start"):
            warm = warm_start_sft(base_model, output_root, warm_start_source, warm_start_steps, params, settings,
                                  lr=warm_start_lr, max_tokens=max_tokens)
            after_warm = trainjob_stage(base_model=warm.outputs["model_uri"], **rl).set_display_name(
                f"{method} trainjob")
        with dsl.Else(name="no-warm-start"):
            cold = trainjob_stage(base_model=base_model, **rl).set_display_name(f"{method} trainjob")
        return dsl.OneOf(after_warm.output, cold.output)

    @dsl.pipeline(name=f"{method}-stage")
    def rl_stage(
        data: Input[Dataset],
        output_root: str,
        base_model: str,
        steps: int,
        batch_size: int,
        learning_rate: float,
        engine: str,
        method_options: dict,
        warm_start_source: str,
        warm_start_steps: int,
        warm_start_lr: float,
        max_tokens: int,
        placement: str,
        num_nodes: int,
        gpus_per_node: int,
        rollout_replicas: int,
        rollout_gpus: int,
        tensor_parallel_size: int,
        gpu_count: int,
        accelerator_type: str,
        node_selector: dict,
        tolerations: list,
        s3_secret_name: str,
    ) -> str:
        """RL training with an optional SFT warm start, in one pod or as a TrainJob; returns the model's URI.

        Args:
            data: Prepared rl dataset.
            output_root: Where runs are written (s3://bucket/prefix; a local directory for single_pod local runs).
            base_model: Model to start from.
            steps: RL learner steps.
            batch_size: Trajectories per step.
            learning_rate: Policy learning rate.
            engine: Rollout engine: vllm or hf.
            method_options: Other RLConfig fields.
            warm_start_source: SFT data source of the warm start.
            warm_start_steps: SFT steps before RL (0 = no warm start).
            warm_start_lr: Learning rate of the warm start.
            max_tokens: Token limit of warm-start examples.
            placement: single_pod (rollout service and learner in one pod) or trainjob (one Kubeflow Trainer TrainJob).
            num_nodes: trainjob: learner nodes.
            gpus_per_node: trainjob: GPUs per learner node.
            rollout_replicas: trainjob: rollout service replicas.
            rollout_gpus: trainjob: GPUs per rollout replica.
            tensor_parallel_size: trainjob: vLLM tensor-parallel size inside a replica.
            gpu_count: GPUs of the training pods (single_pod RL and the warm-start SFT).
            accelerator_type: Kubernetes resource name of the GPUs.
            node_selector: Node labels the GPU pods require.
            tolerations: Tolerations of the GPU pods.
            s3_secret_name: Secret with the S3 credentials.
        """
        common = dict(data=data, output_root=output_root, base_model=base_model, steps=steps, batch_size=batch_size,
                      learning_rate=learning_rate, engine=engine, method_options=method_options,
                      warm_start_source=warm_start_source, warm_start_steps=warm_start_steps,
                      warm_start_lr=warm_start_lr, max_tokens=max_tokens, gpu_count=gpu_count,
                      accelerator_type=accelerator_type, node_selector=node_selector, tolerations=tolerations,
                      s3_secret_name=s3_secret_name)
        with dsl.If(placement == "trainjob", name="trainjob"):
            multi = trainjob_rl_stage(**common, num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                                      rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                                      tensor_parallel_size=tensor_parallel_size).set_display_name(
                f"{method} as a TrainJob (optional warm start)")
        with dsl.Else(name="single-pod"):
            single = single_pod_rl_stage(**common).set_display_name(f"{method} in one pod (optional warm start)")
        return dsl.OneOf(multi.output, single.output)

    return rl_stage


def build_evaluation_stage(settings: k8s.ClusterSettings):
    """Evaluation of one model on a list of benchmarks (one parallel step each) and one report."""
    from components.evaluate import evaluate
    from components.report import report

    @dsl.pipeline(name="evaluation-stage")
    def evaluation_stage(
        model: str,
        output_root: str,
        benchmarks: list,
        k: int,
        limit: int,
        engine: str,
        max_new_tokens: int,
        max_total_tokens: int,
        temperature: float,
        sandbox: str,
        previous_summary: str,
        eval_options: dict,
        gpu_count: int,
        accelerator_type: str,
        node_selector: dict,
        tolerations: list,
        s3_secret_name: str,
        trained_model: str = "",
        adapter: str = "",
    ) -> str:
        """Evaluate `model` on each benchmark in parallel, then write one report; returns the report's URI.

        Args:
            model: Model reference to evaluate.
            output_root: Where runs are written.
            benchmarks: Benchmark names.
            k: Samples per problem.
            limit: First N problems of each benchmark (0 = all).
            engine: vllm or hf.
            max_new_tokens: Tokens per model turn.
            max_total_tokens: Tokens of a whole episode.
            temperature: Sampling temperature.
            sandbox: SWE sandbox: kubernetes or local.
            previous_summary: Earlier summary.json to compare against ('' = none).
            eval_options: Other EvalConfig fields.
            gpu_count: GPUs of each evaluation pod.
            accelerator_type: Kubernetes resource name of the GPUs.
            node_selector: Node labels the evaluation pods require.
            tolerations: Tolerations of the evaluation pods.
            s3_secret_name: Secret with the S3 credentials.
            trained_model: The model the pipeline trained (= model), whose training run the report shows ('' = none).
            adapter: LoRA adapter merged into model before it is evaluated ('' = none).
        """
        params = k8s.ClusterParams(gpu_count=gpu_count, accelerator_type=accelerator_type,
                                   node_selector=node_selector, tolerations=tolerations,
                                   s3_secret_name=s3_secret_name)
        with dsl.ParallelFor(benchmarks, name="benchmarks") as benchmark:
            step = evaluate(model=model, adapter=adapter, output_root=output_root, benchmarks=benchmark, k=k,
                            limit=limit, engine=engine, max_new_tokens=max_new_tokens,
                            max_total_tokens=max_total_tokens, temperature=temperature, sandbox=sandbox,
                            previous_summary=previous_summary, options=eval_options,
                            run_id=RUN_ID).set_display_name("evaluate")
            k8s.apply(step, "evaluation", params, settings, image_kind="rollout")
        final = report(summaries=dsl.Collected(step.outputs["summary"]), output_root=output_root,
                       previous_summary=previous_summary, run_id=RUN_ID,
                       trained_model=trained_model).set_display_name("report")
        k8s.apply(final, "cpu", params, settings, image_kind="cpu")
        return final.outputs["report_uri"]

    return evaluation_stage
