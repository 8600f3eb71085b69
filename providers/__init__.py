"""What training state is: providers describe it as items and restore it; they move no bytes."""

from .atomic import ChildRestoreError
from .base import CheckedProvider, ReadState, RestoreError, StateProvider, fresh_keys, require_keys
from .composite import CompositeProvider, ProviderNameError, sub_state
from .items import SERIALIZERS, Item, ObjectItem, Serializer, ShardInfo, TensorItem
from .materialize import MetaBufferError, empty_init, materialize
from .module import ModuleProvider
from .objects import ObjectProvider
from .optimizer import OptimizerProvider
from .rng import RNGProvider
from .stateful import Stateful, StatefulProvider
from .tensors import TensorDictProvider
from .tree import TENSOR_MARKER, join_tensors, split_tensors

__all__ = [
    "SERIALIZERS",
    "TENSOR_MARKER",
    "CheckedProvider",
    "ChildRestoreError",
    "CompositeProvider",
    "Item",
    "MetaBufferError",
    "ModuleProvider",
    "ObjectItem",
    "ObjectProvider",
    "OptimizerProvider",
    "ProviderNameError",
    "RNGProvider",
    "ReadState",
    "RestoreError",
    "Serializer",
    "ShardInfo",
    "StateProvider",
    "Stateful",
    "StatefulProvider",
    "TensorDictProvider",
    "TensorItem",
    "fresh_keys",
    "empty_init",
    "join_tensors",
    "materialize",
    "require_keys",
    "split_tensors",
    "sub_state",
]
