"""What every stage of a run shares: its config and workdir, and the policy, tasks, mesh, environment pool
and rollout engine it builds once and caches."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import shutil
from typing import Any, Iterator

import ml_collections

from guijax.models.lora import from_run_config
from guijax.pipeline.records import StageRecords
from guijax.rng import Streams
from guijax.rollout.prompt import coordinates_of, grammar_of, prompt_template


def adapter_dir(model_dir: pathlib.Path) -> pathlib.Path:
    """Where a LoRA run's adapters go beside its merged model: `<model dir>_adapter` (not inside it, where
    transformers would take the directory for an adapter instead of a model)."""
    return model_dir.with_name(model_dir.name + "_adapter")



# where the methods' own stages write the LoRA adapters they hand a serving engine: apart from the trainer's
# (`engine_adapters/`), whose pushes and close clear their own folder
STAGE_ADAPTERS = "engine_adapters_stages"


def env_workers(env: ml_collections.ConfigDict) -> int:
    """The environment workers a run's pool holds, so the most episodes one rollout round (one sampler call)
    steps together: one per desktop server on OSWorld, `env.num_workers` on the desk."""
    return len(env.server_urls) if env.kind == "osworld" else env.num_workers

@dataclasses.dataclass
class Run:
    config: ml_collections.ConfigDict
    workdir: pathlib.Path
    records: StageRecords | None = None  # what each stage was made from (None: stages run on their own)
    _cache: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def streams(self) -> Streams:
        """The run's named random streams (guijax.rng): every draw is keyed by stage and purpose."""
        return Streams(self.config.seed)

    @property
    def system_prompt(self) -> str:
        return prompt_template(self.config.rollout.prompt)

    @property
    def grammar(self) -> str:
        """The action grammar `rollout.prompt` asks the policy to write (envs.actions.grammar)."""
        return grammar_of(self.config.rollout.prompt)

    def mesh(self):
        """The training mesh: every device, or those past `rollout.sampler_devices` when the sampler has its own."""
        if "mesh" not in self._cache:
            from guijax.sharding import MeshConfig, make_mesh

            learner, _ = self._device_split()
            self._cache["mesh"] = make_mesh(MeshConfig.from_run_config(self.config), devices=learner)
        return self._cache["mesh"]

    def sampler_mesh(self):
        """The asynchronous sampler's own mesh (parameters split over its devices), or None when it shares the
        training mesh."""
        from guijax.sharding import MeshConfig, make_mesh

        _, sampler = self._device_split()
        return None if sampler is None else make_mesh(MeshConfig(data=1, fsdp=-1), devices=sampler)

    def _device_split(self) -> tuple[list | None, list | None]:
        import jax

        n = self.config.rollout.get("sampler_devices", 0)
        if not n:
            return None, None
        if self.config.rollout.get("mode", "sync") != "async":
            raise ValueError(f"rollout.sampler_devices={n} gives the sampler its own devices, which only "
                             "asynchronous rollouts use: set rollout.mode=async or rollout.sampler_devices=0")
        devices = jax.devices()
        if n >= len(devices):
            raise ValueError(f"rollout.sampler_devices={n} leaves no device to train on ({len(devices)} devices)")
        return devices[n:], devices[:n]

    @property
    def base_model_dir(self) -> pathlib.Path:
        return pathlib.Path(self.config.model.path) if self.config.model.path else self.workdir / "base_model"

    def load_policy(self, path: pathlib.Path, trains: ml_collections.ConfigDict | None = None):
        """The policy in `path`. A policy that `trains` (under that config: the run's, or a method's) gets
        fresh LoRA adapters when its `lora.rank` is positive and holds its `model.frozen` groups fixed; one
        that only samples is the plain model."""
        from guijax.models.policy import from_pretrained

        lora = None if trains is None else from_run_config(trains)
        policy = from_pretrained(path, dtype=self.config.model.dtype,
                                 param_dtype=self.config.model.param_dtype or None, mesh=self.mesh(),
                                 remat_policy=self.config.model.remat,
                                 attention_impl=self.config.model.get("attention", "auto"),
                                 scan_layers=self.config.model.scan_layers, lora=lora,
                                 lora_seed=self.streams.seed_for("lora_init"),
                                 frozen=() if trains is None else tuple(trains.model.frozen),
                                 attention_block=self.config.model.attention_block,
                                 expert_capacity_factor=self.config.model.get("expert_capacity_factor", 0.0))
        processor = policy.processor
        if self.config.model.image_max_pixels:
            processor.image_processor = dataclasses.replace(processor.image_processor,
                                                            max_pixels=self.config.model.image_max_pixels)
        return policy

    def save_trained(self, policy, path: pathlib.Path) -> pathlib.Path:
        """A trained policy as a Hugging Face checkpoint in `path` (LoRA adapters merged), and under LoRA the
        adapters alone in PEFT's format in `<path>_adapter`, for the checkpoint the policy was loaded from."""
        from guijax.models.peft_format import save_adapter
        from guijax.models.policy import save_pretrained

        if policy.module.lora is not None:
            save_adapter(adapter_dir(path), policy.params, policy.cfg, policy.module.lora,
                         str(policy.path.resolve()) if policy.path else "")
        return save_pretrained(policy, path)

    def tasks(self) -> dict[str, list]:
        from envs.tasks import load_tasks

        if "tasks" not in self._cache:
            data = json.loads((self.workdir / "splits.json").read_text())
            tasks = {t.id: t for t in load_tasks(self.workdir / "tasks.json")}
            self._cache["tasks"] = {name: [tasks[i] for i in ids] for name, ids in data.items()}
        return self._cache["tasks"]

    def pool(self):
        if "pool" not in self._cache:
            from envs.pool import DeskFactory, EnvPool

            e = self.config.env
            if e.kind == "desk":
                factories = DeskFactory(tuple(e.screen), e.step_limit, self.streams.seed_for("env"), e.popups,
                                        e.step_latency_s)
            elif e.kind == "osworld":
                import os

                from envs.client import RemoteFactory

                if not e.server_urls:
                    raise ValueError("env.kind='osworld' needs env.server_urls: one desktop server (an OSWorld VM "
                                     "or `python -m envs.server`) per rollout worker")
                token = os.environ.get(e.server_token_env) if e.server_token_env else None
                factories = [RemoteFactory(url, token, e.step_limit, tuple(e.cache_dirs)) for url in e.server_urls]
            else:
                raise ValueError(f"unknown env.kind {e.kind!r}; choose 'desk' or 'osworld'")
            workers = env_workers(e)
            if e.fleet == "ray":
                from envs.ray_pool import RayEnvPool

                self._cache["pool"] = RayEnvPool(factories, workers, address=e.ray_address,
                                                 cpus_per_worker=e.ray_cpus_per_worker, timeout_s=e.timeout_s)
            else:
                self._cache["pool"] = EnvPool(factories, workers, timeout_s=e.timeout_s)
        return self._cache["pool"]

    def engine(self, policy, temperature: float):
        """A rollout engine over the run's environments sampling `policy` with the sampler `rollout.backend`
        names (the methods' own stages, which sample between their own updates: a serving engine, the process's
        one, is handed the policy's parameters whenever they are not what it serves)."""
        from guijax.trainer import rollout_config

        return self._rollout_engine(policy, temperature, rollout_config(self.config, self.system_prompt),
                                    self.workdir / STAGE_ADAPTERS)

    @contextlib.contextmanager
    def evaluation_engine(self, policy, temperature: float, prompt: str | None = None) -> Iterator[Any]:
        """A rollout engine sampling `policy` with the sampler `eval.backend` names, for evaluations, prompted
        with `prompt` (a `rollout.prompt` name; default the run's): a serving engine (the process's one, started
        from this policy's checkpoint directory if none is kept) is handed the policy's parameters before the
        first sample; leaving closes what the sampler owns."""
        from guijax.trainer import rollout_config

        ev = self.config.eval
        settings = dataclasses.replace(rollout_config(self.config, self.system_prompt),
                                       parse_retries=ev.get("parse_retries", 0),
                                       retry_temperature_decay=ev.get("parse_retry_decay", 0.5))
        if prompt is not None and prompt != self.config.rollout.prompt:
            settings = dataclasses.replace(settings, system_prompt=prompt_template(prompt), grammar=grammar_of(prompt),
                                           coordinate_model=coordinates_of(prompt))
        engine = self._rollout_engine(policy, temperature, settings, self.workdir / "engine_adapters",
                                      backend=ev.get("backend", "jax"))
        try:
            yield engine
        finally:
            engine.close()

    def _rollout_engine(self, policy, temperature: float, settings: Any, adapter_root: pathlib.Path,
                        backend: str | None = None):
        """A rollout engine with `settings` over the run's pool, its sampler `backend`'s (default
        `rollout.backend`); the pool is started before a serving engine, so a pool that fails leaves none."""
        from guijax.rollout.backend import make_sampler
        from guijax.rollout.engine import RolloutEngine
        from guijax.trainer import sampling_config

        mesh = self.mesh()
        pool = self.pool()
        sampler = make_sampler(self.config, policy.module,
                               sampling_config(self.config, policy.processor, temperature, mesh), mesh,
                               policy.processor.tokenizer, policy.path, adapter_root=adapter_root, backend=backend)
        return RolloutEngine(pool, sampler, policy.processor, settings)

    def close(self) -> None:
        """The environments closed, and the adapters handed to a serving engine by the methods' own stages
        removed (their samplers stay with the process's engine, so nothing else removes them)."""
        if "pool" in self._cache:
            self._cache["pool"].close()
        shutil.rmtree(self.workdir / STAGE_ADAPTERS, ignore_errors=True)

    def all_tasks(self) -> list:
        """Every task of every split once, in split order."""
        seen, out = set(), []
        for tasks in self.tasks().values():
            for t in tasks:
                if t.id not in seen:
                    seen.add(t.id)
                    out.append(t)
        return out

    def expert_traces(self) -> dict[str, Any]:
        """{task id: converted expert trajectory (D_conv)} written by the expert stage."""
        from guijax.data.store import TrajectoryStore

        if "expert_traces" not in self._cache:
            if not (self.workdir / "expert.json").exists():
                raise FileNotFoundError(f"{self.workdir}/expert.json missing: add the 'expert' stage to config.stages "
                                        "before the stage that reads the expert traces")
            self._cache["expert_traces"] = {t.task_id: t for t in TrajectoryStore(self.workdir / "expert_traces")}
        return self._cache["expert_traces"]

    def forget_tasks(self) -> None:
        """Stages that rewrite splits.json call this so later stages read the new splits."""
        self._cache.pop("tasks", None)
