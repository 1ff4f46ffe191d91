/**
 * The order vitest starts its files in (vitest.config.ts `sequence.sequencer`): longest first, by how long
 * each held its worker in a CI run (file-seconds.json, written by scripts/file-seconds.mjs). vitest's own
 * order puts the longest first only from a local results cache, which a clean clone has none of: there the
 * order is the file system's, and a long WebGPU suite could start last and run alone at the end while the
 * other worker idles. Files the table does not know (under 3 s, or new) come after it, in vitest's order.
 *
 * The files of a project that shares its processes (isolate: false) come first, together: vitest hands a
 * finished file's process to the next file only when that file is queued next and of the same project.
 */
import { readFileSync } from 'node:fs';
import { relative } from 'node:path';
import { BaseSequencer, type TestSpecification } from 'vitest/node';

const SECONDS = JSON.parse(readFileSync(new URL('./file-seconds.json', import.meta.url), 'utf8')) as Record<string, number>;

export class LongestFirst extends BaseSequencer {
  override async sort(files: TestSpecification[]): Promise<TestSpecification[]> {
    const root = this.ctx.config.root;
    const seconds = (f: TestSpecification) => SECONDS[relative(root, f.moduleId).split('\\').join('/')] ?? 0;
    const base = await super.sort(files);
    return base
      .map((file, i) => ({ file, i, shared: file.project.config.isolate ? 0 : 1, s: seconds(file) }))
      .sort((a, b) => b.shared - a.shared || b.s - a.s || a.i - b.i)
      .map((x) => x.file);
  }
}
