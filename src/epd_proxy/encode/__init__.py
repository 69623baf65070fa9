"""The encode path: everything the proxy does only for requests with media.

``multimodal.py`` finds the media items (and the keys they are cached under),
``media_policy.py`` decides which of them a client may ask for,
``encoder_plan.py`` batches them into encoder sub-requests, ``ec_match.py``
matches each encoder's answer to its items and builds what the consumer gets,
and ``fanout.py`` (``EncoderFanout``) runs the encode stage. All but the last
are pure.
"""
