"""DualPath inside vLLM: the KV connector, the proxy and the serve launcher.

vLLM, zmq and aiohttp are imported inside these modules only; the rest of the package never imports them.
"""
