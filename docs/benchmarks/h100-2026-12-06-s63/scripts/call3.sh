#!/bin/bash
# Call 3: whole loops, graphs off (G) against on (D), alternated, against mlx-lm's plain;
# then round_profile arms S (SwiGLU form) / G / R (the drafter's opt-in parts).
TAG=c3a PER=140 bash .sweep/s63/loop.sh "${LOOP:-G:cur D:cur G:cur D:cur}"
TAG=c3r PER=120 bash .sweep/s63/rounds.sh "${ARMS:-S:cur G:cur R:cur S:cur}"
