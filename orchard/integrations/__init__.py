"""Adapters that let existing agent harnesses run on Orchard sandboxes unchanged.

``mini_swe_agent.OrchardEnvironment`` (mini-swe-agent's environment protocol) and
``swe_rex.OrchardDeployment`` / ``OrchardRuntime`` (SWE-ReX's abstract deployment and
runtime, which SWE-agent uses). Each imports its harness only when used.
"""
