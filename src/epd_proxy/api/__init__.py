"""The proxy's HTTP surface besides generation: the route table and the operator endpoints
(``app``), the roster administration (``admin``), who may do what (``access``, ``client_auth``)
and the asking of sibling workers (``siblings``)."""
