"""What an operator configures: the instances of each role (``instances.py``) and the
proxy's settings, one typed section per concern (``sections.py``) under one ``ProxyConfig``
(``proxy.py``); how a configuration names its mistakes (``checks.py``).

A leaf of the package: it imports nothing of it, and everything reads it.
"""

from epd_proxy.config.checks import ConfigErrors, check_range, gather
from epd_proxy.config.instances import (
    DNS_PREFIX,
    ROLES,
    InstanceSpec,
    check_zmq_endpoint,
    parse_instance,
    split_discovered,
    split_instances,
    url_mistake,
)
from epd_proxy.config.proxy import (
    LOG_LEVELS,
    NO_DECODE,
    ROLE_POLICY_DEFAULTS,
    SECTION_OF,
    SECTIONS,
    ProxyConfig,
    ServeOptions,
)
from epd_proxy.config.sections import (
    ALWAYS_FORWARDED,
    ENCODER_FALLBACKS,
    LOG_FORMATS,
    REFUSED_FORWARD_HEADERS,
    TOPOLOGIES,
    AccessConfig,
    AdmissionConfig,
    EncodersConfig,
    HealthConfig,
    KvEventsConfig,
    ListenerConfig,
    LoraConfig,
    MediaConfig,
    MembershipConfig,
    MultiTurnConfig,
    ObservabilityConfig,
    RoutingConfig,
    StageTimeouts,
    StateStoreConfig,
    UpstreamConfig,
    check_forward_headers,
)

__all__ = [
    "ALWAYS_FORWARDED", "DNS_PREFIX", "ENCODER_FALLBACKS", "LOG_FORMATS", "LOG_LEVELS", "NO_DECODE",
    "REFUSED_FORWARD_HEADERS", "ROLES", "ROLE_POLICY_DEFAULTS", "SECTIONS", "SECTION_OF", "TOPOLOGIES",
    "AccessConfig", "AdmissionConfig", "ConfigErrors", "EncodersConfig", "HealthConfig", "InstanceSpec",
    "KvEventsConfig", "ListenerConfig", "LoraConfig", "MediaConfig", "MembershipConfig", "MultiTurnConfig",
    "ObservabilityConfig", "ProxyConfig", "RoutingConfig", "ServeOptions", "StageTimeouts", "StateStoreConfig",
    "UpstreamConfig", "check_forward_headers", "check_range", "check_zmq_endpoint", "gather", "parse_instance",
    "split_discovered", "split_instances", "url_mistake",
]
