from openjev.v1 import decision_pb2 as _decision_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QuestionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUESTION_KIND_UNSPECIFIED: _ClassVar[QuestionKind]
    QUESTION_KIND_CHOICE: _ClassVar[QuestionKind]
    QUESTION_KIND_SCORE: _ClassVar[QuestionKind]
    QUESTION_KIND_NOUL: _ClassVar[QuestionKind]
QUESTION_KIND_UNSPECIFIED: QuestionKind
QUESTION_KIND_CHOICE: QuestionKind
QUESTION_KIND_SCORE: QuestionKind
QUESTION_KIND_NOUL: QuestionKind

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_questions", "max_candidates", "max_batch_candidates", "max_launch_sequences", "max_launch_tokens", "queue_capacity", "max_request_tokens")
    MAX_QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    MAX_LAUNCH_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_LAUNCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_questions: int
    max_candidates: int
    max_batch_candidates: int
    max_launch_sequences: int
    max_launch_tokens: int
    queue_capacity: int
    max_request_tokens: int
    def __init__(self, max_questions: _Optional[int] = ..., max_candidates: _Optional[int] = ..., max_batch_candidates: _Optional[int] = ..., max_launch_sequences: _Optional[int] = ..., max_launch_tokens: _Optional[int] = ..., queue_capacity: _Optional[int] = ..., max_request_tokens: _Optional[int] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("abi_version", "model_id", "alias", "checkpoint_revision", "temperature", "max_length", "limits", "tokenizer_fingerprint", "backend", "default_prefix_policy", "execute_unary", "weights_fingerprint")
    ABI_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_REVISION_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PREFIX_POLICY_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_UNARY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    abi_version: int
    model_id: str
    alias: str
    checkpoint_revision: str
    temperature: float
    max_length: int
    limits: Limits
    tokenizer_fingerprint: str
    backend: str
    default_prefix_policy: _decision_pb2.PrefixPolicy
    execute_unary: bool
    weights_fingerprint: str
    def __init__(self, abi_version: _Optional[int] = ..., model_id: _Optional[str] = ..., alias: _Optional[str] = ..., checkpoint_revision: _Optional[str] = ..., temperature: _Optional[float] = ..., max_length: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., tokenizer_fingerprint: _Optional[str] = ..., backend: _Optional[str] = ..., default_prefix_policy: _Optional[_Union[_decision_pb2.PrefixPolicy, str]] = ..., execute_unary: _Optional[bool] = ..., weights_fingerprint: _Optional[str] = ...) -> None: ...

class QuestionShape(_message.Message):
    __slots__ = ("kind", "num_candidates")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    kind: QuestionKind
    num_candidates: int
    def __init__(self, kind: _Optional[_Union[QuestionKind, str]] = ..., num_candidates: _Optional[int] = ...) -> None: ...

class ExecuteHeader(_message.Message):
    __slots__ = ("request_id", "prefix_policy", "questions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_POLICY_FIELD_NUMBER: _ClassVar[int]
    QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefix_policy: _decision_pb2.PrefixPolicy
    questions: _containers.RepeatedCompositeFieldContainer[QuestionShape]
    def __init__(self, request_id: _Optional[str] = ..., prefix_policy: _Optional[_Union[_decision_pb2.PrefixPolicy, str]] = ..., questions: _Optional[_Iterable[_Union[QuestionShape, _Mapping]]] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("question_index", "candidate_index", "token_ids")
    QUESTION_INDEX_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    question_index: int
    candidate_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, question_index: _Optional[int] = ..., candidate_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CandidateBatch(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    def __init__(self, candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("header", "batch", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: ExecuteHeader
    batch: CandidateBatch
    commit: Commit
    def __init__(self, header: _Optional[_Union[ExecuteHeader, _Mapping]] = ..., batch: _Optional[_Union[CandidateBatch, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ...) -> None: ...

class QuestionResult(_message.Message):
    __slots__ = ("question_index", "probabilities", "head_scores")
    QUESTION_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    HEAD_SCORES_FIELD_NUMBER: _ClassVar[int]
    question_index: int
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    head_scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, question_index: _Optional[int] = ..., probabilities: _Optional[_Iterable[float]] = ..., head_scores: _Optional[_Iterable[float]] = ...) -> None: ...

class ExecutionSummary(_message.Message):
    __slots__ = ("policy", "executed_policy", "prefix_enabled", "scope", "saved_tokens", "computed_tokens", "submitted_tokens", "num_launches", "inference_seconds", "queue_seconds")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EXECUTED_POLICY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ENABLED_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    SAVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy: _decision_pb2.PrefixPolicy
    executed_policy: _decision_pb2.PrefixPolicy
    prefix_enabled: bool
    scope: _decision_pb2.PrefixScope
    saved_tokens: int
    computed_tokens: int
    submitted_tokens: int
    num_launches: int
    inference_seconds: float
    queue_seconds: float
    def __init__(self, policy: _Optional[_Union[_decision_pb2.PrefixPolicy, str]] = ..., executed_policy: _Optional[_Union[_decision_pb2.PrefixPolicy, str]] = ..., prefix_enabled: _Optional[bool] = ..., scope: _Optional[_Union[_decision_pb2.PrefixScope, str]] = ..., saved_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., submitted_tokens: _Optional[int] = ..., num_launches: _Optional[int] = ..., inference_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("question", "summary")
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    question: QuestionResult
    summary: ExecutionSummary
    def __init__(self, question: _Optional[_Union[QuestionResult, _Mapping]] = ..., summary: _Optional[_Union[ExecutionSummary, _Mapping]] = ...) -> None: ...

class ExecuteUnaryRequest(_message.Message):
    __slots__ = ("header", "candidates")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    header: ExecuteHeader
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    def __init__(self, header: _Optional[_Union[ExecuteHeader, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ...) -> None: ...

class ExecuteUnaryResponse(_message.Message):
    __slots__ = ("questions", "summary")
    QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    questions: _containers.RepeatedCompositeFieldContainer[QuestionResult]
    summary: ExecutionSummary
    def __init__(self, questions: _Optional[_Iterable[_Union[QuestionResult, _Mapping]]] = ..., summary: _Optional[_Union[ExecutionSummary, _Mapping]] = ...) -> None: ...
