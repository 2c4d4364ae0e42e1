#!/bin/bash
mkdir -p /tmp/stage && cp .device/qa/p0 /tmp/stage/p0 && ls -l /tmp/stage && nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
