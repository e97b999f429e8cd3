"""Capacity planning for `pdorch plan`: traffic profiles, the layout planner, its input
documents and its report. Pure, and used only by the CLI: it sits beside the request path
(`orchestrator.core`, whose roofline model and GPU table it reads) rather than in it.
"""
