"""Parity harness: ``check(family, ...)`` returns a :class:`~mmparity.parity.report.Report`."""


def check(*args, **kwargs):
    from mmparity.parity.harness import check as _check

    return _check(*args, **kwargs)
