/**
 * How the browser node meets its outside world: the donor page, which sees
 * it only as a NodeEngine (src/host/browser/engine.ts) through the worker. This
 * file turns the runtime's facts into the page's NodeStatus, and any failure
 * into a code and what the donor can do about it.
 */
import { ModelFetchError } from '../../model/errors.ts';
import { isMeshErrorCode, type MeshErrorCode } from '../../protocol/errors.ts';
import type { NodeRuntime } from '../../node/runtime/runtime.ts';
import { NodeState } from '../../node/runtime/state.ts';
import type { BackendInfo, NodeConfig, NodeErrorInfo, NodeStatus } from './engine.ts';
import { isQuotaError } from './storage.ts';
import type { Q4Counters } from './q4-store.ts';
import type { StorageCounters } from './adapter.ts';

/** What the donor can do about each failure, by code; anything else: Retry. */
const ACTIONS: Partial<Record<MeshErrorCode, string>> = {
  MESH_ERR_QUOTA: 'Free disk space or clear other sites’ data (browser settings → Privacy → Site data), or open this page with fewer layers; then press Retry. Layers already stored are kept.',
  MESH_ERR_MODEL_FETCH: 'Check that the model server is up and reachable, then press Retry: the download resumes where it stopped.',
  MESH_ERR_MODEL_FORMAT: 'The model files are not what this node can run; check the model URL.',
  MESH_ERR_WEIGHTS_CORRUPT: 'Press Retry: the damaged layer is fetched again.',
  MESH_ERR_LAYER_RANGE: 'Open the page with a layer range inside the model.',
};

/** Every failure the donor can see, with its code (docs/protocol.md §6) and what to do about it. */
export function describeError(e: unknown): NodeErrorInfo {
  const err = e as { name?: string; message?: string; code?: unknown };
  let code: MeshErrorCode = isMeshErrorCode(err?.code) ? err.code : 'MESH_ERR_INTERNAL';
  let message = err?.message ?? String(e);
  if (isQuotaError(e)) code = 'MESH_ERR_QUOTA';
  // fetch() rejects with TypeError("Failed to fetch") when the server is gone.
  else if (code === 'MESH_ERR_INTERNAL' && err?.name === 'TypeError' && /fetch|network/i.test(message)) {
    code = 'MESH_ERR_MODEL_FETCH';
    message = `model server unreachable: ${message}`;
  } else if (e instanceof ModelFetchError) message = `model download failed: ${message}`;
  const action = ACTIONS[code] ?? (code === 'MESH_ERR_INTERNAL' ? 'Press Retry; if it fails again, reload the page and report this message.' : 'Press Retry; if it fails again, reload the page.');
  return { code, message: code === 'MESH_ERR_QUOTA' && !(e instanceof Error) ? 'browser storage is full' : message, action, retryable: true };
}

export interface PageFacts {
  runtime: NodeRuntime | undefined;
  config: NodeConfig | undefined;
  /** A failure before the runtime could take over (bad config, storage). */
  startError: unknown;
  /** A start is under way (storage, identity) before the runtime runs: already "connecting" for the page. */
  starting: boolean;
  counters: StorageCounters;
  q4: Q4Counters;
  memoryBudgetBytes: number;
  crossOriginIsolated: boolean;
}

/** The page's NodeStatus from the runtime's facts. */
export function pageStatus(f: PageFacts): NodeStatus {
  const rt = f.runtime;
  const span = rt?.span;
  const kv = span?.executor.kvStats();
  const activity = rt?.activity.window;
  const now = Date.now();
  const runtimeState = rt?.state ?? NodeState.Idle;
  const state = f.startError !== undefined ? NodeState.Error : runtimeState === NodeState.Idle && f.starting ? NodeState.Connecting : runtimeState;
  const s: NodeStatus = {
    state,
    storedBytes: f.counters.storedBytes,
    fetchedBytes: f.counters.fetchedBytes,
    quantization: { ...f.q4, quantizeMs: Math.round(f.q4.quantizeMs) },
    requestsServed: activity?.requests ?? 0,
    tokensServed: activity?.tokens ?? 0,
    requestsPerMinute: activity?.requestsPerMinute(now) ?? 0,
    throughput: activity?.tokensPerSecond(now) ?? new Array<number>(60).fill(0),
    recentForwardMs: activity?.recentForwardMs() ?? [],
    sessions: kv?.sessions ?? 0,
    kvBytes: kv?.reservedBytes ?? 0,
    // The budget is the span's weights plus the KV caches: the page shows KV against its own share.
    kvBudgetBytes: kv?.budgetBytes ?? f.memoryBudgetBytes,
    memoryBudgetBytes: f.memoryBudgetBytes,
    crossOriginIsolated: f.crossOriginIsolated,
  };
  const failure = f.startError ?? rt?.error;
  if (failure !== undefined) s.error = describeError(failure);
  else if (rt?.notice && state === NodeState.Connecting) {
    s.error = { code: rt.notice.code, message: rt.notice.message, action: 'Give the mesh more memory (the budget control), or keep the page open: the tracker assigns layers when the picture changes.', retryable: false };
  }
  if (rt) s.peerId = rt.peerId;
  if (f.config) s.relayUrl = f.config.relayUrl;
  if (f.config?.trackerUrl) {
    const a = rt?.assignment;
    s.tracker = { url: f.config.trackerUrl, registered: rt?.trackerRegistered ?? false, assignment: a === undefined ? undefined : a && { startLayer: a.start_layer, endLayer: a.end_layer } };
  }
  if (state === NodeState.Downloading && rt?.loading?.progress) s.download = rt.loading.progress;
  if (span) s.backend = span.backend.details as unknown as BackendInfo;
  const shown = rt?.lastSpan;
  if (shown) {
    const { spec, numLayers } = shown;
    const servesIt = span !== undefined && span.spec.startLayer === spec.startLayer && span.spec.endLayer === spec.endLayer && span.spec.modelUrl === spec.modelUrl;
    s.model = { baseUrl: spec.modelUrl, name: spec.model, numLayers, startLayer: spec.startLayer, endLayer: spec.endLayer, holdsHead: spec.endLayer === numLayers, pipelineHead: servesIt && span.pipeline !== undefined };
  }
  return s;
}
