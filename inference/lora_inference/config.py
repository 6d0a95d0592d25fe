"""Server configuration: one frozen value built by the CLI (or a test) and read everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lora_inference.costs import MergePolicy


@dataclass(frozen=True)
class StaticLora:
    """An adapter named on the command line (`--lora NAME=PATH`): pinned, never unloaded by API."""

    name: str
    path: Path


@dataclass(frozen=True)
class ServerConfig:
    model: Path
    served_model_name: str = ""
    adapter_root: Path | None = None
    # This pod's labels (a Downward API `metadata.labels` file): with it, the resolver serves
    # only adapters whose published target matches them; without it, every adapter on the root.
    pod_labels_file: Path | None = None
    allowed_roots: tuple[Path, ...] = ()
    static_loras: tuple[StaticLora, ...] = ()
    # base_model_name_or_path values (from adapter_config.json) accepted besides the model's own
    # name; adapters that declare another base model are refused.
    accepted_base_models: tuple[str, ...] = ()
    max_loras: int = 4
    max_cpu_loras: int = 32
    max_lora_rank: int = 64
    admin_token: str | None = None
    # Bearer token for generation and the read endpoints (/v1/models, /v1/adapters); the admin
    # token is accepted there too. None: those endpoints are open.
    client_token: str | None = None
    # The tokens' files, read again when they change (a rotated Secret); None: the values above.
    admin_token_file: Path | None = None
    client_token_file: Path | None = None
    # The operator's ServiceAccount ("namespace/name") whose tokens bound to this pod's
    # namespace's audience open load/unload and the reads, checked by TokenReview
    # (tokenreview.py); `pod_namespace` names that namespace. None: the static tokens only.
    operator_service_account: str | None = None
    pod_namespace: str | None = None
    # Resolve from the adapter root only what the operator published (a `target.json` beside
    # it); off, a file or folder placed there by hand is served by its name too.
    published_only: bool = False
    # Whether a generation request may register an adapter itself (`lora.local_path`).
    allow_request_adapters: bool = True
    device: str = "cpu"
    dtype: str = "auto"
    max_batch_size: int = 4
    max_queue: int = 64
    max_skips: int = 4
    # Single-adapter batches merge the adapter into the layers where the measured cost model
    # says it pays (auto), into every layer (always) or none (never).
    merge: MergePolicy = "auto"
    host: str = "0.0.0.0"
    port: int = 8000
    # A simulated GPU's profile (`--simulate`, lora_inference.simulate): the pipeline sleeps for
    # its costs; benchmarks and tests only. None: a real pipeline.
    simulate: str | None = None

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model.name

    @property
    def path_roots(self) -> tuple[Path, ...]:
        """Where clients may point `lora_path` / `local_path`: allowed roots and adapter root."""
        roots = list(self.allowed_roots)
        if self.adapter_root is not None:
            roots.append(self.adapter_root)
        return tuple(roots)

    def check(self) -> None:
        """Refuse contradictory settings with a message that says what to change."""
        if self.max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras}): every adapter on the GPU is also cached on the CPU"
            )
        if len(self.static_loras) > self.max_loras:
            raise ValueError(
                f"{len(self.static_loras)} --lora adapters are pinned but --max-loras is "
                f"{self.max_loras}; raise --max-loras"
            )
        if self.merge not in ("auto", "always", "never"):
            raise ValueError(f"--merge must be auto, always or never, got {self.merge!r}")
        if self.operator_service_account is not None:
            ns, _, name = self.operator_service_account.partition("/")
            if not ns or not name or "/" in name:
                raise ValueError("--operator-service-account takes NAMESPACE/NAME")
            if not self.pod_namespace:
                raise ValueError(
                    "--operator-service-account needs this pod's namespace: --pod-namespace "
                    "or the environment variable POD_NAMESPACE (the Downward API's "
                    "metadata.namespace)"
                )
        if self.max_batch_size < 1 or self.max_queue < 1:
            raise ValueError("--max-batch-size and --max-queue must be at least 1")
        names = [s.name for s in self.static_loras]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora names must be unique, got {', '.join(names)}")
