{{- /*
The operator's permissions, exactly what tests/chart/test_rbac.py derives from the operator's code
(kopf handlers and Kubernetes API calls) and from kopf's own needs: the test fails when a rule is
missing and when a rule grants something nothing uses.

Rules on cluster-scoped resources (always in the ClusterRole):
- customresourcedefinitions list/watch: kopf discovers InferenceService and follows CRD changes.
- namespaces list/watch (named namespaces only): kopf follows the watched namespaces' lifecycle.
- clusterkopfpeerings (all namespaces, peering on): the operator creates its peering object at
  startup (get/create); kopf keeps it alive and watches its peers (list/watch/patch).
*/ -}}
{{- define "kvfleet.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if not (include "kvfleet.clusterWide" .) }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- if and .Values.peering.enabled (include "kvfleet.clusterWide" .) }}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end }}
{{- end }}

{{- /*
Rules on namespaced resources: in the ClusterRole (all namespaces) or a Role per watched namespace.
- inferenceservices: kopf lists/watches them and patches its annotations and finalizer; the
  reconcile of a child's owner reads it (get). The spec is never written.
- inferenceservices/status: conditions, observedGeneration, replicas, url, autoscaling.
- inferenceservices/finalizers update: the children's ownerReferences set blockOwnerDeletion, which
  clusters with the OwnerReferencesPermissionEnforcement admission plugin (OpenShift) allow only to
  whoever may update the owner's finalizers. No request of the operator uses it.
- deployments, services, poddisruptionbudgets: the children, read, created, patched, deleted.
- pods: list, for the autoscaler to scrape each ready serving pod's /metrics and for the reconcile to
  report failing pods; watch, so that a pod failure reaches the status at once; patch, for the
  controller.kubernetes.io/pod-deletion-cost annotation set before a scale-down (the only pod
  writes: the ReplicaSet then removes the idlest pods; pod-patch-policy.yaml denies any other change);
  get, because the endpoint picker's Role grants it.
- spec.routing (docs/routing.md): inferencepools and httproutes, read, created, patched, deleted and
  watched (an owned one that changes is reconciled); gateways, read (a missing Gateway is Degraded);
  configmaps, serviceaccounts, roles, rolebindings of the endpoint picker, read, created, patched,
  deleted. Kubernetes lets the operator write a Role only with permissions it holds itself, so it also
  holds what the endpoint picker's Role grants, read-only: pods, inferencepools, and llm-d.ai
  inferenceobjectives / inferencemodelrewrites.
- events: create: the autoscaler's Kubernetes Events on InferenceServices (scale decisions); list/watch:
  Warning Events about pods (FailedMount, FailedAttachVolume) to report why a serving pod does not start.
- jobs: the model-download Jobs of a shared model cache: created once per pinned revision, deleted
  when no longer pinned, listed and watched (a finished download moves the Deployment). Never patched.
- persistentvolumeclaims: the shared model cache's claim: read, created, patched (a larger size),
  deleted when the InferenceService leaves the shared mode.
- kopfpeerings (named namespaces, peering on): as clusterkopfpeerings above, per namespace.
Nothing on secrets: serving pods read secretKeyRef env, and download pods spec.model.credentialsSecret
(envFrom), through the kubelet, not the operator.
*/ -}}
{{- define "kvfleet.namespacedRules" -}}
- apiGroups: ["serving.kvfleet.dev"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.kvfleet.dev"]
  resources: ["inferenceservices/status"]
  verbs: ["patch"]
- apiGroups: ["serving.kvfleet.dev"]
  resources: ["inferenceservices/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["gateways"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["configmaps", "serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["llm-d.ai"]
  resources: ["inferenceobjectives", "inferencemodelrewrites"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list", "watch"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create", "patch", "delete"]
{{- if and .Values.peering.enabled (not (include "kvfleet.clusterWide" .)) }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end }}
{{- end }}
