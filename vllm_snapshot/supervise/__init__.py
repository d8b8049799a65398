"""The engine's supervisor side: launching the engine tree, its channel and log, the listening
socket handed to a restored tree, and the front-end options applied at restore. Imports checkpoint and below."""
