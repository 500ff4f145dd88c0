"""Engine exceptions: specific, so the HTTP edge can map each one once to an OpenAI error."""
from __future__ import annotations


class EngineError(Exception):
    """Base class of everything the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as given (the server answers 400)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the model's context (``max_model_len``) or the KV pool."""


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is already in the engine."""


class ModelLoadError(EngineError):
    """A checkpoint directory or preset cannot be loaded (missing files, unsupported config)."""


class EngineDeadError(EngineError):
    """The async engine's loop has stopped; no request can be served any more."""


class EngineStepError(EngineError):
    """A step's compute failed; ``request_ids`` (that step's batch) were aborted, others live."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


class LoRAError(EngineError):
    """Base class of the LoRA adapter errors below."""


class LoRAAdapterNotFoundError(LoRAError):
    """No adapter by this name is loaded, or no PEFT adapter exists at the given path (404)."""


class InvalidLoRAAdapterError(LoRAError):
    """The adapter exists but cannot be served: format, config, target modules, rank or shapes (400)."""


class LoRAAdapterConflictError(LoRAError):
    """Loading would replace something: the name is already loaded (without ``load_inplace``),
    or it is the base model's name (400)."""


class LoRADisabledError(LoRAError):
    """The engine was started without LoRA support (``enable_lora``) (400)."""


class LoRAUnavailableError(LoRAError):
    """A registered adapter cannot be read back from disk as it was registered: its files
    vanished or changed since (503; load it again)."""
