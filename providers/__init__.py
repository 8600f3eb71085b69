"""What training state is: providers describe it as items and restore it; they move no bytes."""

from providers.base import RestoreError, StateProvider, require_keys
from providers.composite import ChildRestoreError, CompositeProvider, sub_state
from providers.items import SERIALIZERS, Item, ObjectItem, Serializer, ShardInfo, TensorItem
from providers.module import ModuleProvider
from providers.objects import ObjectProvider
from providers.optimizer import OptimizerProvider
from providers.rng import RNGProvider
from providers.stateful import Stateful, StatefulProvider
from providers.tensors import TensorDictProvider
from providers.tree import TENSOR_MARKER, join_tensors, split_tensors

__all__ = [
    "SERIALIZERS",
    "TENSOR_MARKER",
    "ChildRestoreError",
    "CompositeProvider",
    "Item",
    "ModuleProvider",
    "ObjectItem",
    "ObjectProvider",
    "OptimizerProvider",
    "RNGProvider",
    "RestoreError",
    "Serializer",
    "ShardInfo",
    "StateProvider",
    "Stateful",
    "StatefulProvider",
    "TensorDictProvider",
    "TensorItem",
    "join_tensors",
    "require_keys",
    "split_tensors",
    "sub_state",
]
