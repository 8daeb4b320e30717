#!/bin/sh
# The container's entry point. SageMaker starts a hosting container as `docker run IMAGE serve` and calls
# port 8080; everywhere else `serve` listens on $PORT (default 8000). Anything else runs as a jaxstream command
# (`docker run IMAGE transcribe FILE`, `... eval CORPUS`).
set -e
if [ "$1" = "serve" ]; then
    shift
    if [ -n "$SM_MODEL_DIR" ] || [ "$SAGEMAKER_BIND_TO_PORT" ]; then
        PORT="${SAGEMAKER_BIND_TO_PORT:-8080}"
    fi
    exec jaxstream serve --host 0.0.0.0 --port "${PORT:-8000}" "$@"
fi
exec jaxstream "$@"
