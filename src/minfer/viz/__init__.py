"""`minfer viz`: a web page over the live compute graph and a per-step trace of a generation.

session (the model or saved trace behind the page), diff (one prompt on two backends, node by
node), app (the FastAPI routes), static/ (the page and its vendored Cytoscape.js). The graph as
the page draws it is `minfer.graph.view`'s; the trace is recorded by minfer.engine.trace.
"""
