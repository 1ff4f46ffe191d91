/** What a NodeRuntime tells its host (runtime.ts): its events, and the load in progress. */
import type { ModelConfig } from '../../model/config.ts';
import type { Assignment, GenerateEvent } from '../../protocol/tracker.ts';
import type { DownloadProgress, SpanSpec } from './host.ts';
import type { LoadedSpan } from './span.ts';
import type { NodeState } from './state.ts';

export type RuntimeEvent =
  | { type: 'state'; state: NodeState }
  | { type: 'registered'; assignment: Assignment | null }
  | { type: 'serving'; span: SpanSpec; loadMs: number; rebuilt?: LoadedSpan['rebuilt']; backend: string }
  | { type: 'load-failed'; span: SpanSpec; error: unknown }
  | { type: 'generate'; event: GenerateEvent; sessionId: string }
  /** A draining heartbeat signed beside each heartbeat, for a host that must tell the tracker without waiting (a page's freeze handler). */
  | { type: 'drain-beacon'; url: string; body: string };

/** The span being loaded now (for the page's progress), with its model's size. */
export interface LoadProgress {
  phase: 'downloading' | 'loading';
  spec: SpanSpec;
  config: ModelConfig;
  progress: DownloadProgress | undefined;
}
