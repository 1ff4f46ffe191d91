/** The errors a node's tracker client (tracker-client.ts) throws for the tracker's answers, beside MeshError's own. */
import { MeshError } from '../protocol/errors.ts';

/** The tracker has no `GET /api/nodes/watch` (an older one). */
export class WatchUnsupportedError extends MeshError {
  constructor() {
    super('MESH_ERR_NOT_FOUND', 'the tracker has no /api/nodes/watch');
  }
}

/** The tracker could not be reached at all (connection refused or reset, no such host): not a timeout, not an answer. */
export class TrackerUnreachableError extends MeshError {
  constructor(message: string) {
    super('MESH_ERR_UNAVAILABLE', message);
  }
}

/** The tracker forgot this node (it restarted): register again. */
export class NotRegisteredError extends MeshError {
  constructor() {
    super('MESH_ERR_NOT_FOUND', 'the tracker does not know this node (it restarted?); register again');
  }
}
