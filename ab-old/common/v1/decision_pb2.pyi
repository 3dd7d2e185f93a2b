from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefixPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFIX_POLICY_UNSPECIFIED: _ClassVar[PrefixPolicy]
    PREFIX_POLICY_OFF: _ClassVar[PrefixPolicy]
    PREFIX_POLICY_DEFAULT: _ClassVar[PrefixPolicy]
    PREFIX_POLICY_SHARED: _ClassVar[PrefixPolicy]
    PREFIX_POLICY_FIXED: _ClassVar[PrefixPolicy]
    PREFIX_POLICY_AUTO: _ClassVar[PrefixPolicy]

class PrefixScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFIX_SCOPE_UNSPECIFIED: _ClassVar[PrefixScope]
    PREFIX_SCOPE_NONE: _ClassVar[PrefixScope]
    PREFIX_SCOPE_WITHIN_QUESTION: _ClassVar[PrefixScope]
    PREFIX_SCOPE_ACROSS_QUESTIONS: _ClassVar[PrefixScope]
PREFIX_POLICY_UNSPECIFIED: PrefixPolicy
PREFIX_POLICY_OFF: PrefixPolicy
PREFIX_POLICY_DEFAULT: PrefixPolicy
PREFIX_POLICY_SHARED: PrefixPolicy
PREFIX_POLICY_FIXED: PrefixPolicy
PREFIX_POLICY_AUTO: PrefixPolicy
PREFIX_SCOPE_UNSPECIFIED: PrefixScope
PREFIX_SCOPE_NONE: PrefixScope
PREFIX_SCOPE_WITHIN_QUESTION: PrefixScope
PREFIX_SCOPE_ACROSS_QUESTIONS: PrefixScope

class DecideRequest(_message.Message):
    __slots__ = ("request_json", "prefix_policy")
    REQUEST_JSON_FIELD_NUMBER: _ClassVar[int]
    PREFIX_POLICY_FIELD_NUMBER: _ClassVar[int]
    request_json: str
    prefix_policy: PrefixPolicy
    def __init__(self, request_json: _Optional[str] = ..., prefix_policy: _Optional[_Union[PrefixPolicy, str]] = ...) -> None: ...

class ChoiceAnswer(_message.Message):
    __slots__ = ("choice", "confidence")
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    choice: str
    confidence: float
    def __init__(self, choice: _Optional[str] = ..., confidence: _Optional[float] = ...) -> None: ...

class ScoreAnswer(_message.Message):
    __slots__ = ("score", "confidence", "legend_json")
    SCORE_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    LEGEND_JSON_FIELD_NUMBER: _ClassVar[int]
    score: float
    confidence: float
    legend_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, score: _Optional[float] = ..., confidence: _Optional[float] = ..., legend_json: _Optional[_Iterable[str]] = ...) -> None: ...

class NoulAnswer(_message.Message):
    __slots__ = ("noul",)
    NOUL_FIELD_NUMBER: _ClassVar[int]
    noul: float
    def __init__(self, noul: _Optional[float] = ...) -> None: ...

class Answer(_message.Message):
    __slots__ = ("question_id", "keys", "probabilities", "choice", "score", "noul")
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    NOUL_FIELD_NUMBER: _ClassVar[int]
    question_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    choice: ChoiceAnswer
    score: ScoreAnswer
    noul: NoulAnswer
    def __init__(self, question_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., probabilities: _Optional[_Iterable[float]] = ..., choice: _Optional[_Union[ChoiceAnswer, _Mapping]] = ..., score: _Optional[_Union[ScoreAnswer, _Mapping]] = ..., noul: _Optional[_Union[NoulAnswer, _Mapping]] = ...) -> None: ...

class PrefixCache(_message.Message):
    __slots__ = ("policy", "enabled", "scope", "saved_tokens")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    SAVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    policy: PrefixPolicy
    enabled: bool
    scope: PrefixScope
    saved_tokens: int
    def __init__(self, policy: _Optional[_Union[PrefixPolicy, str]] = ..., enabled: _Optional[bool] = ..., scope: _Optional[_Union[PrefixScope, str]] = ..., saved_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("input_tokens", "output_tokens")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    output_tokens: int
    def __init__(self, input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class Metadata(_message.Message):
    __slots__ = ("method", "temperature", "candidate_sequences", "inference_seconds", "max_length", "prefix_cache")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    method: str
    temperature: float
    candidate_sequences: int
    inference_seconds: float
    max_length: int
    prefix_cache: PrefixCache
    def __init__(self, method: _Optional[str] = ..., temperature: _Optional[float] = ..., candidate_sequences: _Optional[int] = ..., inference_seconds: _Optional[float] = ..., max_length: _Optional[int] = ..., prefix_cache: _Optional[_Union[PrefixCache, _Mapping]] = ...) -> None: ...

class DecideResponse(_message.Message):
    __slots__ = ("model", "answers", "usage", "metadata")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    model: str
    answers: _containers.RepeatedCompositeFieldContainer[Answer]
    usage: Usage
    metadata: Metadata
    def __init__(self, model: _Optional[str] = ..., answers: _Optional[_Iterable[_Union[Answer, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., metadata: _Optional[_Union[Metadata, _Mapping]] = ...) -> None: ...

class DescribeModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeModelResponse(_message.Message):
    __slots__ = ("model_id", "accepted_names", "checkpoint_revision", "temperature", "max_length", "max_questions", "max_candidates", "default_prefix_policy", "backend")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NAMES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_REVISION_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PREFIX_POLICY_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    accepted_names: _containers.RepeatedScalarFieldContainer[str]
    checkpoint_revision: str
    temperature: float
    max_length: int
    max_questions: int
    max_candidates: int
    default_prefix_policy: PrefixPolicy
    backend: str
    def __init__(self, model_id: _Optional[str] = ..., accepted_names: _Optional[_Iterable[str]] = ..., checkpoint_revision: _Optional[str] = ..., temperature: _Optional[float] = ..., max_length: _Optional[int] = ..., max_questions: _Optional[int] = ..., max_candidates: _Optional[int] = ..., default_prefix_policy: _Optional[_Union[PrefixPolicy, str]] = ..., backend: _Optional[str] = ...) -> None: ...
