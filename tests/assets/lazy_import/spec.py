"""A spec whose functions import a module beside it only when they run (issue 13, item 4)."""

import torch


def build_model():
    import ampdoctor_lazy_helper

    return ampdoctor_lazy_helper.Net()


def build_dataloader():
    import ampdoctor_lazy_helper

    return ampdoctor_lazy_helper.batches()


def loss_fn(output, target):
    import ampdoctor_lazy_helper

    return ampdoctor_lazy_helper.loss(output, target)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-2)
