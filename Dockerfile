# One image for every Reverie service: migrate, worker, beat (and `reverie run` for cron).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True

WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY worker ./worker
COPY tasks ./tasks
COPY schedules ./schedules
COPY store ./store
# The same pinned set as CI and the README: an unpinned install is how a dependency
# release breaks the image without a change here.
RUN pip install -c constraints.txt . && useradd --create-home --uid 10001 reverie

USER reverie
WORKDIR /home/reverie
EXPOSE 9540
CMD ["reverie", "worker"]
