"""Ray for specrl's actors: importing it with a message where it is missing, starting (or
joining) a cluster, and checking that a local one has the CPUs the run's actors ask for."""

from __future__ import annotations

import logging
import os

from specrl.config import Config, RayInitConfig
from specrl.errors import UserError


def import_ray(what: str = "rollout.num_workers > 0"):
    try:
        import ray
    except ImportError:
        raise UserError(
            f"{what} needs Ray: pip install 'specrl[ray]' (or set rollout.num_workers=0 and "
            "actor.num_workers=1 to run in the trainer's process)"
        ) from None
    return ray


def require_cpus(ray, cfg: Config) -> None:
    """Stop with a message, not a hang, when the run's actors ask a local Ray for more CPUs
    than it has (Ray would wait for them forever)."""
    if cfg.ray_kwargs.ray_init.address is not None:
        return
    needed = cfg.rollout.num_workers * cfg.rollout.num_cpus_per_worker
    if cfg.learner_ranks > 1:
        needed += cfg.learner_ranks * cfg.actor.num_cpus_per_worker
    have = ray.cluster_resources().get("CPU", 0)
    if needed > have:
        raise UserError(
            f"the rollout workers and learner ranks need {needed} Ray CPUs and the local Ray has "
            f"{have:g}; set ray_kwargs.ray_init.num_cpus={needed} (a local Ray may count more "
            "CPUs than the machine has) or lower the num_cpus_per_worker settings"
        )


RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def token_auth_enabled_notice(record: logging.LogRecord) -> bool:
    """False for Ray's notice that a new local cluster has token authentication on (it is, and
    the cluster is bound to loopback): a run on workers reads like a run in one process. Its
    warning that authentication is *off* still prints."""
    return not record.getMessage().startswith("Token authentication is enabled")


def start_ray(cfg: RayInitConfig) -> None:
    """Join `cfg.address`, or start a local Ray bound to loopback without dashboard or usage
    stats; a Ray already initialised in this process is used as it is."""
    ray = import_ray()
    if ray.is_initialized():
        return
    if cfg.address is not None:
        ray.init(address=cfg.address)
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # workers' lines in the run's log without colour codes around their prefix
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    logging.getLogger(RAY_AUTH_LOGGER).addFilter(token_auth_enabled_notice)
    ray.init(
        num_cpus=cfg.num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
    )
