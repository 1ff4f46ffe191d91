/**
 * The tracker's model loader with hub ids: `--model NAME=hf:ORG/REPO[@REV]`
 * is pinned to its commit first, and the spec keeps the pinned base URL,
 * the one handed to nodes in their assignments, so every node of the mesh
 * loads the same bytes even if the branch moves meanwhile. Plain URLs load
 * as before (through the same fetch: a hub /resolve/ URL given by hand
 * still gets the redirect and token handling).
 */
import { hubEndpoint, hubFetch, isHubRef, resolveHubModel } from '../model/hub.ts';
import { loadModelSpec, type ModelLoader, type SizingOptions } from './model-registry.ts';

export interface HubEnv {
  HF_ENDPOINT?: string;
  HF_TOKEN?: string;
}

export function hubAwareLoader(fetchFn: typeof fetch, sizing: SizingOptions, env: HubEnv): ModelLoader {
  const endpoint = hubEndpoint(env);
  const token = env.HF_TOKEN || undefined;
  const files = hubFetch(fetchFn, { endpoint, ...(token ? { token } : {}) });
  return async (name, url) => {
    if (!isHubRef(url)) return loadModelSpec(name, url, files, sizing);
    const r = await resolveHubModel(fetchFn, url, { endpoint, ...(token ? { token } : {}) });
    return loadModelSpec(name, r.url, files, sizing);
  };
}
