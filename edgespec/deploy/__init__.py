"""The bundle beyond edgespec: llama.cpp's own server (built once by the project, cached), the
llama-server command that runs a bundle's target and draft on one machine or over RPC workers, and
those servers as child processes (the bench's peer and the tests drive them)."""
from __future__ import annotations

from .build import BuildOptions, LlamaCppBuild, find_build, find_or_build, locate
from .command import DeployConfig, ServerCommand, ServerOptions, SpecSettings, deploy_command, server_argv
from .flags import ServerHelp, read_help

__all__ = ["BuildOptions", "LlamaCppBuild", "find_build", "find_or_build", "locate", "DeployConfig", "ServerCommand",
           "ServerOptions", "SpecSettings", "deploy_command", "server_argv", "ServerHelp", "read_help"]
