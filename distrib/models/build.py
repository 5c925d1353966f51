"""Models are plain nn.Modules that know nothing of ranks or devices: the seed Network and user factories.

A factory is `package.module:function` with keyword arguments from model.kwargs, plus num_classes, in_channels and
image_size from the data when it declares them."""

from __future__ import annotations

import torch.nn as nn

from distrib.config import ModelConfig
from distrib.data import DataInfo
from distrib.errors import UserError
from distrib.factory import accepted, call_factory, import_object
from distrib.models.network import NETWORK_INPUT
from distrib.torch_private import BatchNormBase

_BUILTIN = {"network": "distrib.models.network:Network", "gpt": "distrib.models.gpt:GPT"}


def _shape(shape) -> str:
    return "x".join(str(s) for s in shape)


# Every argument data_kwargs may offer a factory.
DATA_KEYS = ("num_classes", "in_channels", "image_size", "in_features", "seq_len", "vocab_size")


def data_kwargs(info: DataInfo) -> dict:
    """What the data tells a factory that asks: num_classes; in_channels and image_size (an int for square images)
    for images; in_features for vectors of features; seq_len and vocab_size (= num_classes) for sequences of integer
    ids."""
    offered = {"num_classes": info.num_classes}
    if len(info.input_shape) == 3:
        channels, *size = info.input_shape
        offered.update(in_channels=channels, image_size=size[0] if size[0] == size[1] else tuple(size))
    elif len(info.input_shape) == 1:
        integer = info.inputs.startswith(("int", "uint"))
        if integer and not info.inputs.startswith("uint8"):
            offered.update(seq_len=info.input_shape[0], vocab_size=info.num_classes)
        else:
            offered["in_features"] = info.input_shape[0]
    return offered


def _named(config: ModelConfig) -> tuple[str, str]:
    """(the config key, 'package.module:function') of the model: model.factory, or model.name's built-in."""
    return ("model.factory", config.factory) if config.factory else ("model.name", _BUILTIN[config.name])


def factory_call(config: ModelConfig, info: DataInfo) -> tuple[str, dict]:
    """The factory as 'package.module:function' (built-ins too) and the exact keyword arguments it is called with:
    the data's num_classes / in_channels / image_size where it declares them, then model.kwargs (which win)."""
    key, spec = _named(config)
    if config.name == "network" and not config.factory and tuple(info.input_shape) != NETWORK_INPUT:
        raise UserError(f"model.name = {config.name!r}: the seed Network takes {_shape(NETWORK_INPUT)} inputs, but "
                        f"the data's are {_shape(info.input_shape)}; set model.factory to a model for "
                        f"{_shape(info.input_shape)} inputs (e.g. --set model.factory=mypkg.models:resnet18)")
    if config.name == "gpt" and not config.factory and len(info.input_shape) != 1:
        raise UserError(f"model.name = 'gpt': takes token ids [seq_len], but the data's inputs are "
                        f"{_shape(info.input_shape)}; train it on --set data.name=text or tokens (or a data.factory "
                        "of int64 [N, T] pairs)")
    offered = accepted(import_object(key, spec), data_kwargs(info))
    return spec, {**offered, **config.kwargs}


def build_model(config: ModelConfig, info: DataInfo) -> nn.Module:
    """A fresh model on whatever device its constructor chose (normally the CPU); placement comes later."""
    spec, kwargs = factory_call(config, info)
    key, _ = _named(config)
    return _checked(key, spec, call_factory(key, spec, import_object(key, spec), kwargs))


def build_without_data(config: ModelConfig) -> nn.Module | None:
    """The model as build_model makes it, before any data is loaded (the launcher's checks build it on the meta
    device): a built-in with its defaults for the data's arguments (they shape its embeddings and classifier, which
    no tensor-parallel plan splits), a factory where model.kwargs gives every data argument it declares; None for a
    factory that needs the data."""
    key, spec = _named(config)
    function = import_object(key, spec)
    if config.factory and any(name not in config.kwargs for name in accepted(function, dict.fromkeys(DATA_KEYS))):
        return None
    return _checked(key, spec, call_factory(key, spec, function, dict(config.kwargs)))


def _checked(key: str, spec: str, model) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise UserError(f"{key} = {spec!r}: returned {type(model).__name__}, not an nn.Module; "
                        "return the model from the factory")
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"{key} = {spec!r}: the model has no trainable parameters, so there is nothing to train; "
                        "register its weights as nn.Parameter (layers such as nn.Linear do) and keep requires_grad")
    return model


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of the BatchNorm layers (1d, 2d, 3d, Sync) in the model."""
    return [name for name, module in model.named_modules() if isinstance(module, BatchNormBase)]
