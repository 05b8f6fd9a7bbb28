"""Every attribute, span, event and instrument name otel-rl emits.

No other module spells these names as string literals; docs/semconv.md is the
table of the same names with their types, meanings and examples (a test keeps
the two in step).
"""

from __future__ import annotations

# --- run identity (resource attributes) -------------------------------------
RL_PROJECT_NAME = "rl.project.name"
RL_EXPERIMENT_NAME = "rl.experiment.name"
RL_RUN_ID = "rl.run.id"
RL_WORKER_RANK = "rl.worker.rank"
SERVICE_NAME = "service.name"  # OpenTelemetry resource convention

# --- span names ---------------------------------------------------------------
SPAN_RUN = "rl.run"
SPAN_STEP = "rl.step"
SPAN_LOG = "rl.log"
SPAN_GENERATIONS = "rl.generations"
SPAN_TRAJECTORY = "rl.trajectory"

# --- training step / trajectory attributes ----------------------------------
RL_STEP = "rl.step"
RL_SAMPLE_INDEX = "rl.sample_index"
RL_ROLLOUT_N = "rl.rollout_n"
RL_VALIDATE = "rl.validate"
RL_TRAJECTORY_NAME = "rl.trajectory.name"
RL_REWARD = "rl.reward"
RL_TURN_INDEX = "rl.turn.index"
RL_TIMER_NAME = "rl.timer.name"
RL_SAMPLED = "rl.sampled"

# --- span kinds (what a tracker shows: AGENT / LLM / TOOL / ...) -------------
RL_SPAN_KIND = "rl.span.kind"
KIND_STEP = "STEP"
KIND_TIMER = "TIMER"
KIND_AGENT = "AGENT"
KIND_CHAIN = "CHAIN"
KIND_LLM = "LLM"
KIND_TOOL = "TOOL"
KIND_REWARD = "REWARD"
KIND_METRICS = "METRICS"
SPAN_KINDS = (KIND_STEP, KIND_TIMER, KIND_AGENT, KIND_CHAIN, KIND_LLM, KIND_TOOL, KIND_REWARD, KIND_METRICS)

# --- op inputs / outputs ------------------------------------------------------
RL_OP_INPUTS = "rl.op.inputs"  # JSON object of bound arguments
RL_OP_OUTPUT = "rl.op.output"  # JSON of the return value (or yielded items)
RL_OP_QUALNAME = "rl.op.qualname"
RL_TRUNCATED = "rl.truncated"  # true when an input/output hit the size cap

# --- lossless step metrics (rl.log spans) -----------------------------------
RL_METRICS_KEYS = "rl.metrics.keys"  # string[]: every key of the log() call, in call order
RL_METRICS_VALUES = "rl.metrics.values"  # double[] parallel to rl.metrics.keys
RL_METRICS_INT_KEYS = "rl.metrics.int_keys"  # string[] of integer-valued keys (exact values below)
RL_METRICS_INT_VALUES = "rl.metrics.int_values"  # int[] parallel to the above
RL_METRICS_BOOL_KEYS = "rl.metrics.bool_keys"  # string[] of boolean-valued keys
RL_METRICS_BOOL_VALUES = "rl.metrics.bool_values"  # bool[] parallel to the above

# --- validation generations (rl.generations spans) --------------------------
RL_GENERATIONS_INPUTS = "rl.generations.inputs"
RL_GENERATIONS_OUTPUTS = "rl.generations.outputs"
RL_GENERATIONS_SCORES = "rl.generations.scores"

# --- run start (rl.run span) -------------------------------------------------
RL_RUN_CONFIG = "rl.run.config"  # JSON of the (secret-scrubbed) training config

# --- token2text -----------------------------------------------------------------
PROMPT_IDS = "prompt_ids"
RESPONSE_IDS = "response_ids"
PROMPT_TEXT = "prompt_text"
RESPONSE_TEXT = "response_text"

# --- OpenTelemetry GenAI semantic conventions --------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE = "gen_ai.tool.type"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"
ERROR_TYPE = "error.type"  # OpenTelemetry general convention

GEN_AI_OP_CHAT = "chat"
GEN_AI_OP_TEXT_COMPLETION = "text_completion"
GEN_AI_OP_EXECUTE_TOOL = "execute_tool"
GEN_AI_OP_INVOKE_AGENT = "invoke_agent"

# --- exception event (OpenTelemetry convention) ------------------------------
EVENT_EXCEPTION = "exception"
EXCEPTION_TYPE = "exception.type"
EXCEPTION_MESSAGE = "exception.message"
EXCEPTION_STACKTRACE = "exception.stacktrace"

# --- metric instruments ---------------------------------------------------------
METRIC_PREFIX = "rl.train."  # a log() key "actor/pg_loss" -> gauge "rl.train.actor/pg_loss"
METRIC_TRAJECTORY_DURATION = "rl.trajectory.duration"
METRIC_TRAJECTORIES = "rl.trajectories"
METRIC_TOOL_CALLS = "rl.tool.calls"
METRIC_TOOL_ERRORS = "rl.tool.errors"
METRIC_GEN_AI_TOKEN_USAGE = "gen_ai.client.token.usage"
METRIC_GEN_AI_OPERATION_DURATION = "gen_ai.client.operation.duration"
METRIC_EXPORT_ITEMS = (
    "otel_rl.exporter.items"  # counter, attr outcome=exported|failed|dropped|retried|spooled|rejected|shed
)
METRIC_EXPORT_QUEUED = "otel_rl.exporter.queued"
METRIC_EXPORT_SPOOL_BYTES = "otel_rl.exporter.spool.bytes"  # gauge: bytes of each exporter's on-disk spool
OUTCOME = "outcome"
EXPORTER = "exporter"
PIPELINE = "pipeline"  # the `exporter` value of the pipeline's own queue (spans shed, records spilled)

# --- tracker-facing names (trace tags, table columns) ------------------------
TAG_STEP = "step"
TAG_SAMPLE_INDEX = "sample_index"
TAG_ROLLOUT_N = "rollout_n"
TAG_VALIDATE = "validate"
TAG_EXPERIMENT_NAME = "experiment_name"
TAG_REWARD = "reward"
VAL_GENERATIONS_KEY = "val/generations"
TIMING_PREFIX = "timing_s/"

# --- environment variables -----------------------------------------------------
ENV_PREFIX = "OTEL_RL_"
ENV_RUN_ID = "OTEL_RL_RUN_ID"
ENV_RANK = "OTEL_RL_RANK"
